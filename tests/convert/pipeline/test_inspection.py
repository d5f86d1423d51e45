"""inspection.py: `inspect_checkpoint` returns an `InspectReport`, which the CLI prints and dumps."""
import json

from click.testing import CliRunner

from megamoe_convert.testing import synth
from megamoe_convert.cli.main import main
from megamoe_convert.pipeline.inspection import InspectReport, inspect_checkpoint

SMALL = dict(num_layers=2, hidden=256, intermediate=128, num_experts=4, top_k=2)


def test_report_is_a_dataclass_whose_dict_is_the_cli_json(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL, shared=1)
    rep = inspect_checkpoint(src, ep_size=2)
    assert isinstance(rep, InspectReport) and rep.ok and rep.problems == []
    assert (rep.format, rep.row, rep.ep_size) == ("modelopt-nvfp4", "nvfp4", 2)
    assert rep.scales["pairs"] == 8 and rep.shared["present"]
    res = CliRunner().invoke(main, ["inspect", str(src), "--ep-size", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert res.output == json.dumps(rep.to_dict(), indent=2) + "\n"
    assert list(json.loads(res.output)) == [  # the key order the report always had
        "source", "kind", "revision", "files", "bytes", "format", "row", "model", "recipe", "activations", "layers",
        "layer_groups", "shapes", "shared", "scales", "ep_size", "estimated_expert_bytes", "passthrough_bytes",
        "estimated_output_bytes", "problems", "warnings",
        "repairs", "tensor_bytes", "options", "ok", "exit_code"]  # issue 31: appended, the order above kept


def test_a_problem_makes_it_not_ok_and_the_cli_exit_2(tmp_path):
    src = synth.build_synthetic_checkpoint(tmp_path / "src", "modelopt-nvfp4", **SMALL)
    rep = inspect_checkpoint(src, ep_size=3)  # 4 experts do not split over 3 ranks
    assert not rep.ok and rep.problems
    res = CliRunner().invoke(main, ["inspect", str(src), "--ep-size", "3"])
    assert res.exit_code == 2 and "problems (convert would refuse):" in res.output
    # negative control: the same checkpoint on 2 ranks is convertible
    assert inspect_checkpoint(src, ep_size=2).ok


def test_output_estimate_counts_headers_index_and_manifest(tmp_path):
    """inspect's estimate is what convert writes, within 1%, on committed real exports: the safetensors
    headers (built by the writer's own header builder from the plan), the index and megamoe.json count
    (before, only tensor bytes and the copied files did: 686.79 KB estimated for 716.07 KB written)."""
    from pathlib import Path

    from megamoe_convert.pipeline.convert import convert

    real = Path(__file__).resolve().parents[2] / "fixtures" / "real"
    for name, ep in (("modelopt-nvfp4-qwen3moe", 1), ("llmcompressor-nvfp4-qwen3moe", 2)):
        rep = inspect_checkpoint(real / name, ep_size=ep)
        out = tmp_path / name
        convert(real / name, out, ep_size=ep)
        written = sum(p.stat().st_size for p in out.iterdir())
        assert abs(rep.estimated_output_bytes - written) <= 0.01 * written, (name, rep.estimated_output_bytes, written)
