"""RL algorithm maths: advantage estimators and policy-gradient losses, as pure tensor functions."""
