"""``jaxpar ckpt inspect / transform / merge`` (run as ``python -m jaxpar.checkpoint``)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxpar.checkpoint as ckpt
from jaxpar.cli import main as jaxpar_main
from workers_ckpt import common



def main(argv):
    """``jaxpar ckpt ARGV``."""
    return jaxpar_main(["ckpt", *argv])


TP = {"mesh": {"data": 2, "model": 4}, "rules": {"mlp": "model"}}


def test_inspect_transform_merge(tmp_path, capsys):
    trainer = common.mlp_trainer()
    common.run(trainer, 2)
    ckpt.save(trainer, tmp_path / "src", data_state={"epoch": 1})
    expected = common.values(trainer)

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": common.ROOT}
    out = subprocess.run([sys.executable, "-m", "jaxpar.cli", "ckpt", "inspect", str(tmp_path / "src"), "--json"],
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
    # an output that already holds the step: one line naming it and the way out, nothing rewritten
    assert main(["merge", str(tmp_path / "tp"), str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"already holds step 2 ({tmp_path / 'merged' / '2'}); give another" in err, err
    with pytest.raises(ValueError, match="already holds step 2"):
        ckpt.transform(tmp_path / "src", tmp_path / "tp", ckpt.strategy_config(ckpt.load_strategy(tmp_path / "tp")))

    # --to a checkpoint directory in a fresh process: its mesh's 8 simulated devices are asked for
    # before the directory is read (reading it with orbax started JAX on 1 device: refused)
    done = subprocess.run([sys.executable, "-m", "jaxpar.cli", "ckpt", "transform", str(tmp_path / "src"), "--to",
                           str(tmp_path / "tp"), str(tmp_path / "copied")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0 and "WARNING" not in done.stderr, done.stderr
    assert ckpt.inspect(tmp_path / "copied")["mesh"]["axes"] == {"data": 2, "model": 4}

    assert main(["inspect", str(tmp_path / "missing")]) == 2     # a user error: exit 2, one line


def _half(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _array_file(step_dir):
    return max((p for p in (step_dir / "state" / "d").iterdir()), key=lambda p: p.stat().st_size)


# Each kind of damage, as (what, how): the step directory is passed to ``how``.
DAMAGE = {
    "truncated array file": lambda d: _half(_array_file(d)),
    "deleted array file": lambda d: _array_file(d).unlink(),
    "garbage array metadata": lambda d: (d / "state" / "_METADATA").write_bytes(b"\x07garbage{]"),
    "deleted array metadata": lambda d: (d / "state" / "_METADATA").unlink(),
    "deleted state manifest": lambda d: (d / "state" / "manifest.ocdbt").unlink(),
    "missing meta item": lambda d: shutil.rmtree(d / "meta"),
    "truncated strategy file": lambda d: _half(d / "strategy" / "metadata"),
}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    directory = tmp_path_factory.mktemp("two_steps") / "ckpt"
    trainer = common.mlp_trainer()
    for _ in range(2):
        common.run(trainer, 1)
        ckpt.save(trainer, directory)
    return directory


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_inspect_and_merge_name_the_damage(two_steps, tmp_path, capsys, damage):
    directory = tmp_path / "ckpt"
    shutil.copytree(two_steps, directory)
    DAMAGE[damage](directory / "2")
    for command in (["inspect", str(directory)], ["merge", str(directory), str(tmp_path / "merged")]):
        assert main(command) == 2, (damage, command)
        err = capsys.readouterr().err
        # one line naming the step and the damage, and where to go instead: no tensorstore dump, no traceback
        assert err.count("\n") == 1 and "Traceback" not in err and "tensorstore_spec" not in err, err
        assert f"jaxpar ckpt {command[0]}: error: checkpoint step 2 in {directory} is damaged (" in err, err
        assert "Read another complete step [1]" in err, err
    assert not (tmp_path / "merged").exists()
    assert main(["inspect", str(directory), "--step", "1", "--json"]) == 0       # the step before is intact
    assert json.loads(capsys.readouterr().out)["step"] == 1


def test_merge_onto_a_full_disk_is_one_line(two_steps, tmp_path, monkeypatch, capsys):
    from test_checkpoint_robust import fill_disk

    fill_disk(monkeypatch, tmp_path / "merged")
    assert main(["merge", str(two_steps), str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxpar ckpt merge: error: saving checkpoint step 2 to {tmp_path / 'merged'} failed: "
                          "[Errno 28] No space left on device") and err.count("\n") == 1, err
