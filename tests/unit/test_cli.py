"""Tier 1: the ``epcomm`` command line: parsing, errors, ``--list``, ``env`` (no process group)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epcomm import cli


def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_bench_defaults():
    a = parse("bench")
    assert a.command == "bench" and a.cases is None and a.mode == "both" and a.backend == "auto"
    assert a.iters is None and a.warmup is None and a.world_size is None and a.device == "auto"
    assert a.sets == 4 and not a.cached and not a.no_graph and a.out is None and a.plot is None


def test_bench_every_option():
    a = parse("bench", "--cases", "ht-dsv3,sweep", "--mode", "ht", "--tokens", "1,4,16", "--hidden", "1024",
              "--topk", "4", "--experts", "64", "--backend", "reference", "--num-sms", "24", "--iters", "7",
              "--warmup", "0", "--world-size", "2", "--device", "cpu", "--out", "r.jsonl", "--plot", "p",
              "--cached", "--no-graph", "--no-check", "--no-progress", "--seed", "3", "--sets", "2")
    assert a.cases == ["ht-dsv3", "sweep"] and a.tokens == [1, 4, 16] and a.hidden == 1024
    assert (a.topk, a.experts, a.num_sms, a.iters, a.warmup, a.world_size) == (4, 64, [24], 7, 0, 2)
    assert a.backend == "reference" and a.mode == "ht" and a.device == "cpu" and a.seed == 3
    assert a.out == "r.jsonl" and a.plot == "p" and a.cached and a.no_graph and a.no_check and a.no_progress


@pytest.mark.parametrize("argv", [
    ("bench", "--tokens", "1,x"), ("bench", "--tokens", "0"), ("bench", "--iters", "0"),
    ("bench", "--mode", "fast"), ("bench", "--backend", "nccl"), ("bench", "--warmup", "-1"),
    ("bench", "--cases", ","),
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "bench" in capsys.readouterr().out


def test_list(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert "ht-dsv3:" in out and "ht T=4096 H=7168 K=8 E=256" in out and "dsv3: ht-dsv3, ll-dsv3, ll-dsv3-288" in out


def test_user_errors_are_one_line(capsys):
    assert cli.main(["bench", "--cases", "nope", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epcomm bench: error: unknown case 'nope'")
    assert cli.main(["bench", "--cases", "small", "--num-sms", "3", "--device", "cpu"]) == 2
    assert "--num-sms must be even" in capsys.readouterr().err
    assert cli.main(["bench", "--cases", "ll-dsv3-288", "--world-size", "5", "--device", "cpu"]) == 2
    assert "divisible by the world size 5" in capsys.readouterr().err


def test_env_on_this_machine(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for section in ("== versions", "== GPUs", "== symmetric memory", "== environment variables",
                    "== backend a Buffer would choose"):
        assert section in out
    assert "EPCOMM_BACKEND" in out and "here: " in out


def test_python_dash_m_epcomm():
    p = subprocess.run([sys.executable, "-m", "epcomm", "--help"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert p.returncode == 0 and "bench" in p.stdout and "env" in p.stdout and "check" in p.stdout


def test_nvlink_on_cpu_is_a_user_error(capsys):
    assert cli.main(["bench", "--cases", "small", "--backend", "nvlink", "--device", "cpu"]) == 2
    assert "--backend nvlink needs CUDA GPUs" in capsys.readouterr().err
