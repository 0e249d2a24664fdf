import json
from layercut.compress.cli import main
from tests.test_quantize import small_dir  # noqa: F401

def test_x(small_dir, tmp_path, capsys):
    out = tmp_path / "mix"
    code = main(["quantize", str(small_dir), "-o", str(out), "--avg-bits", "3.7", "--group-size", "32",
                 "--candidates", "2,4", "--unit", "group", "--samples", "4", "--seq-len", "32",
                 "--sensitivity-samples", "2", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    alloc = json.loads((out / "allocation.json").read_text())
    print("REPORT", {k: v for k, v in report.items() if k not in ("layers",)})
    print("ALLOC", {k: v for k, v in alloc.items() if k != "units"})
    print("UNIT", alloc["units"][0])
