"""RL algorithm maths: advantage estimators and policy-gradient losses, as pure tensor functions.
A new estimator or loss is one registered function here and its test in tests/algo/."""
