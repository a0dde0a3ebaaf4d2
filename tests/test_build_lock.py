"""One builder per model at a time: a second process that needs a model another is building waits
for that build and uses it, instead of building it again (test workers, sweep jobs and runs started
together share the model cache)."""

import os
import shutil
import subprocess
import sys
import textwrap

from workbench.models.tiny import one_builder, tiny_model_path

# the second process: building anything is a failure here, finding the model is success
SECOND = textwrap.dedent(
    """
    import contextlib

    import workbench.models.tiny as tiny

    def refuse(*args, **kwargs):
        raise SystemExit("built the model a second time")

    lock = tiny.one_builder

    @contextlib.contextmanager
    def announced(target):
        # found no model, about to wait for the builder
        print("waiting", flush=True)
        with lock(target):
            yield

    tiny.build_model = refuse
    tiny.one_builder = announced
    print(tiny.tiny_model_path())
    """
)


def test_a_process_that_needs_a_model_being_built_waits_and_builds_nothing(tmp_path):
    built = tiny_model_path()
    target = tmp_path / "models" / built.name
    with one_builder(target):
        second = subprocess.Popen(
            [sys.executable, "-c", SECOND],
            env={**os.environ, "MOLT_WB_CACHE": str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # the second process found no model and waits for this one's build
        assert second.stdout.readline() == "waiting\n", second.stderr.read()[-2000:]
        # the build this process holds the lock for: the model appears only now
        shutil.copytree(built, target)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-2000:]
    assert out.strip() == str(target)
