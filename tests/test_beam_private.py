"""refinery's uses of Beam's private parts (transforms/core/beam_private.py) still work with
the installed Beam, and that Beam is one they were checked against."""
from __future__ import annotations

import apache_beam

from refinery.transforms.core import beam_private


def test_the_installed_beam_is_one_the_private_hooks_were_checked_against():
    major_minor = ".".join(apache_beam.__version__.split(".")[:2])
    assert major_minor in beam_private.CHECKED_BEAM, (
        f"apache-beam {apache_beam.__version__}: check transforms/core/beam_private.py against it "
        f"(the shared-model key and folder, the Dataflow environment version), then add it to CHECKED_BEAM")


def test_the_shared_model_server_takes_the_key_and_folder(tmp_path):
    from apache_beam.utils import multi_process_shared

    before = beam_private.shared_models_setting()
    try:
        beam_private.secure_shared_models(b"k" * 32, str(tmp_path))
        assert beam_private.shared_models_setting() == (b"k" * 32, str(tmp_path))
        shared = multi_process_shared.MultiProcessShared(dict, tag="refinery-test-beam-private")
        assert shared._path == str(tmp_path)  # where a new sharer puts its address and lock files
    finally:
        beam_private.secure_shared_models(*before)


def test_the_dataflow_environment_version_is_a_version():
    assert beam_private.fnapi_environment_major_version().isdigit()
