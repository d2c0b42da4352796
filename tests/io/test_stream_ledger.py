"""The progress record of a streamed write: what a resumed run reads back, and the runs it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from eqjax.core.errors import InputError, OutputError
from eqjax.io.stream_ledger import StreamLedger, work_directory

RUN = {"model": "/m", "model files": {"a.safetensors": [10, 1]}, "recipe": "w4g128-gptq", "seed": 0}


def test_a_committed_unit_reads_back_exactly(tmp_path):
    work = work_directory(tmp_path / "out")
    assert work == tmp_path / ".out.partial"
    led = StreamLedger(work, RUN, resume=False)
    rng = np.random.default_rng(0)
    streams = {1: [rng.normal(size=(2, 3, 4)).astype(np.float32) for _ in range(3)]}
    with pytest.raises(ValueError, match="before its shard was staged"):
        led.commit("outer", streams, [], False)
    led.stage("outer", {"file": ".shard-outer.safetensors", "tensors": ["t"], "bytes": 4}, {"schemes": {"x": 1}})
    led.commit("outer", streams, [("p", "rtn")], True)
    led.stage("layers_0", None, {"schemes": {"x": 2}})
    led.commit("layers_0", {1: [s + 1 for s in streams[1]]}, [("p", "rtn"), ("q", "gptq")], True)
    assert len(list((work / ".progress").glob("streams-*.npz"))) == 1  # the older activations are dropped

    back = StreamLedger(work, RUN, resume=True)
    assert back.finished() == ["outer", "layers_0"] and back.encoder == {"schemes": {"x": 2}}
    assert back.shards() == [{"file": ".shard-outer.safetensors", "tensors": ["t"], "bytes": 4}]
    got, report, changed = back.restored()
    assert list(got) == [1] and changed and report == [("p", "rtn"), ("q", "gptq")]
    for a, b in zip(got[1], streams[1]):
        assert np.array_equal(a, b + 1)

    fresh = StreamLedger(work, RUN, resume=False)  # without resume: the old record is gone
    assert fresh.finished() == [] and fresh.restored()[0] == {}
    fresh.close()
    assert not (work / ".progress").exists()


def test_another_run_or_a_foreign_directory_is_refused(tmp_path):
    work = work_directory(tmp_path / "out")
    led = StreamLedger(work, RUN, resume=False)
    led.stage("outer", None, {})
    led.commit("outer", {}, [], False)
    changed = {**RUN, "model files": {"a.safetensors": [10, 2]}}
    with pytest.raises(InputError, match=r"differs in model files.*rerun it the same way"):
        StreamLedger(work, changed, resume=True)
    with pytest.raises(InputError, match=r"differs in seed \(0, now 1\)"):
        StreamLedger(work, {**RUN, "seed": 1}, resume=True)
    assert StreamLedger(work, RUN, resume=True).finished() == ["outer"]  # the refusals kept the record
    foreign = work_directory(tmp_path / "other")
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for resume in (False, True):
        with pytest.raises(OutputError, match="holds no eqjax progress record"):
            StreamLedger(foreign, RUN, resume=resume)
    assert (foreign / "notes.txt").read_text() == "mine"
