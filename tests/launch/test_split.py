"""layers = "auto" in [[stages]]: `zmqllm up` and `ray up` split by measured figures
(launch/split.py), probing each distinct stage once, and `zmqllm plan` prints both splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zmqllm import cli
from zmqllm.config.loading import load_config
from zmqllm.config.settings import ConfigError
from zmqllm.config.weighted_split import Figures
from zmqllm.launch import split
from zmqllm.launch.plan import plan

GIB = 1 << 30


def figures(ms_16: float) -> Figures:
    return Figures(ms_16 / 4, ms_16, 64 * GIB, 100 << 20, 200 << 20, 200 << 20, 1 << 30, 0.8)


def config(tmp_path: Path, *stages: str) -> Path:
    path = tmp_path / "c.toml"
    text = '[model]\npath = "tiny"\n'
    for stage in stages:
        text += f"\n[[stages]]\n{stage}\n"
    path.write_text(text)
    return path


def test_auto_is_all_stages_or_none(tmp_path: Path) -> None:
    assert not split.uses_auto(load_config(config(tmp_path, 'layers = "1/2"', 'layers = "2/2"')))
    assert split.uses_auto(load_config(config(tmp_path, 'layers = "auto"', 'layers = "auto"')))
    with pytest.raises(ConfigError, match="every stage or to none"):
        split.uses_auto(load_config(config(tmp_path, 'layers = "auto"', 'layers = "2/2"')))


def test_up_starts_each_stage_with_its_range_of_the_weighted_split(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes: list[tuple[str, ...]] = []

    def fake(path: Path | None, flags: tuple[str, ...]) -> tuple[Figures, int]:
        probes.append(flags)
        return figures(1.0), 16

    monkeypatch.setattr(split, "measure_here", fake)
    path = config(tmp_path, 'layers = "auto"\ncount = 2', 'layers = "auto"')
    cfg = split.auto_stages(load_config(path), path)
    assert len(probes) == 1  # the stages of one machine share its cores: one probe
    assert [s.layers for s in cfg.stages] == ["0:8", "8:16"]
    workers = [c.argv for c in plan(cfg, path) if c.role == "worker"]
    assert [a[a.index("--layers") + 1] for a in workers] == ["0:8", "0:8", "8:16"]


def test_ray_probes_each_stage_with_its_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake(path: Path | None, flags: tuple[str, ...]) -> tuple[Figures, int]:
        threads = int(flags[flags.index("--threads") + 1])
        return figures(4.0 / threads), 16

    monkeypatch.setattr(split, "measure_here", fake)
    path = config(tmp_path, 'layers = "auto"\ncpus = 1', 'layers = "auto"\ncpus = 4')
    cfg = split.auto_stages(load_config(path), path, ray=True)
    (a, b), (c, d) = [tuple(int(x) for x in s.layers.split(":")) for s in cfg.stages]
    assert b - a < d - c  # the stage of 1 CPU gets fewer layers


def test_plan_prints_both_splits_from_figure_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = []
    for name, ms in (("slow", 2.0), ("fast", 1.0)):
        file = tmp_path / f"{name}.json"
        file.write_text(json.dumps({**figures(ms).to_dict(), "num_layers": 16}))
        files.append(str(file))
    path = str(config(tmp_path, 'layers = "auto"', 'layers = "auto"'))
    assert cli.main(["plan", "--config", path, "--figures", *files]) == 0
    out = capsys.readouterr().out
    assert "equal" in out and "weighted" in out and "tokens/s" in out
    assert cli.main(["plan", "--config", path, "--figures", *files, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["equal"]["split"] == [[0, 8], [8, 16]]
    assert got["weighted"]["split"][0][1] < 8
    assert got["weighted"]["tokens_per_s"] > got["equal"]["tokens_per_s"]
