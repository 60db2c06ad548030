"""`dhp plan --auto --save` names the saved recipe `<name>_auto` and says where it went."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from dhp.cli import app


@pytest.mark.slow
def test_auto_save_prints_the_path_and_renames_the_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["plan", "conf=tiny_vlm", "cluster.gpus_per_node=2", "--auto", "--dry-run", "--save", "sub/a.yaml"]
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    saved = yaml.safe_load((tmp_path / "sub" / "a.yaml").read_text())
    # its own run name: train.resume=auto of tiny_vlm never finds the auto plan's checkpoints
    assert saved["name"] == "tiny_vlm_auto"
    assert f"{tmp_path / 'sub' / 'a.yaml'}" in out.output
    assert "dhp train conf=sub/a.yaml" in out.output


@pytest.mark.slow
def test_a_name_given_on_the_command_line_is_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["plan", "conf=tiny_vlm", "cluster.gpus_per_node=2", "name=mine", "--auto", "--dry-run"]
    out = CliRunner().invoke(app, [*args, "--json", "--save", "a.yaml"])
    assert out.exit_code == 0, out.output
    assert yaml.safe_load((tmp_path / "a.yaml").read_text())["name"] == "mine"
