"""``jaxpar ckpt inspect / transform / merge`` (run as ``python -m jaxpar.checkpoint``)."""

import json
import os
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp

import jaxpar.checkpoint as ckpt
from jaxpar.ckpt_cli import main
from workers_ckpt import common

TP = {"mesh": {"data": 2, "model": 4}, "rules": {"mlp": "model"}}


def test_inspect_transform_merge(tmp_path, capsys):
    trainer = common.mlp_trainer()
    common.run(trainer, 2)
    ckpt.save(trainer, tmp_path / "src", data_state={"epoch": 1})
    expected = common.values(trainer)

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": common.ROOT}
    out = subprocess.run([sys.executable, "-m", "jaxpar.ckpt_cli", "inspect", str(tmp_path / "src"), "--json"],
                         capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    report = json.loads(out)
    assert report["step"] == 2 and report["meta"]["data_state"] == {"epoch": 1}
    assert report["mesh"]["axes"] == {"data": 8}
    assert report["leaves"]["params/up"] == {"shape": [16, 32], "dtype": "float32", "spec": [],
                                             "logical": ["vocab", "mlp"], "bytes": 2048, "bytes_per_device": 2048}

    (tmp_path / "tp.json").write_text(json.dumps(TP))
    (tmp_path / "typo.json").write_text(json.dumps({**TP, "rules": {"mlpp": "model"}}))
    # a rule no stored leaf (and no rule of the training job) names would leave 'up' replicated: refused
    assert main(["transform", str(tmp_path / "src"), "--to", str(tmp_path / "typo.json"), str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists() and "'mlpp' -> 'model'" in capsys.readouterr().err
    assert main(["transform", str(tmp_path / "src"), "--to", str(tmp_path / "tp.json"), str(tmp_path / "tp")]) == 0
    moved = ckpt.inspect(tmp_path / "tp")
    assert moved["mesh"]["axes"] == {"data": 2, "model": 4}
    assert moved["leaves"]["params/up"]["spec"] == [None, "model"]
    assert moved["leaves"]["opt_state/0/mu/up"]["spec"] == [None, "model"]     # moments follow their parameter
    assert moved["leaves"]["params/up"]["bytes_per_device"] == 512
    tp = common.mlp_trainer(TP)
    ckpt.restore(tp, tmp_path / "tp")
    common.assert_same(common.values(tp), expected)
    assert tp.params["up"].get_value().sharding.spec == ckpt.strategy_specs(ckpt.load_strategy(tmp_path / "tp"))["params/up"]

    assert main(["merge", str(tmp_path / "tp"), str(tmp_path / "merged")]) == 0
    plain = ocp.StandardCheckpointer().restore(tmp_path / "merged" / "2" / "state")   # no jaxpar needed
    np.testing.assert_array_equal(plain["params"]["up"], np.asarray(trainer.params["up"].get_value()))
    assert len(plain["params"]["up"].sharding.device_set) == 1

    assert main(["inspect", str(tmp_path / "missing")]) == 2     # a user error: exit 2, one line
