"""`make bench-peers`: vlmprep's build beside LLaMA-Factory's and ms-swift's own preprocessing on the same records,
same Qwen2-VL processor (saved to a local dir, loaded offline) and the same length; each tool in a fresh process
pinned to one core. One JSON line per measurement on stdout (benchmarks/emit.py).

    python -m benchmarks.peers [--traces 64] [--demo-repeat 500] [--tools vlmprep,llamafactory,ms-swift] [--quick]
        [--end-to-end [--epochs 3] [--batch 1]]

With --end-to-end each tool's train-time data path then runs --epochs times over what its preprocessing wrote
(benchmarks/peers/endtoend.py): a row per tool with what each step cost in CPU seconds on one core, vlmprep's ratios
to each peer beside the goals, and the table on stderr (and in bench-out/peers/end-to-end.md).

The peers live in their own venvs under bench-out/peers/ (benchmarks/peers/venvs.py), never in the project's."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.emit import emit, machine
from benchmarks.inputs import OUT, records, traces
from benchmarks.peers import convert, endtoend, venvs

ROOT = OUT / "peers"
TOOLS = ("vlmprep", "llamafactory", "ms-swift")
# What each output still needs before a training step (read from the tools' own trainers: LLaMA-Factory's collator
# runs the processor on the stored image paths; ms-swift's cached dataset keeps the raw row plus its length and
# encodes it again in its LazyLLMDataset; vlmprep's loader decompresses the stored resized pixels, or decodes and
# resizes the photos the default stores as their bytes, and patchifies).
TRAIN_TIME = {
    "vlmprep": "no tokenizing; zstd-decompress the stored resized pixels (screenshots), or decode and resize the "
    "photos kept as their JPEG bytes; normalize + patchify",
    "llamafactory": "no tokenizing; every image decoded, resized and normalized again by the processor "
    "(the output stores image paths: the source images must ship with it)",
    "ms-swift": "everything again: template + tokenizing and image decode + resize + normalize "
    "(the output stores the raw messages, image paths and a length)",
}


# What `llamafactory-cli train CONFIG` runs before it loads the model (run_sft's first lines): with tokenized_path
# set, get_dataset preprocesses and saves there. Its CLI itself would then go on to load model weights.
LF_PREPROCESS = """
from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
from llamafactory.hparams import get_train_args
from llamafactory.model import load_tokenizer
model_args, data_args, training_args, _, _ = get_train_args()
tokenizer_module = load_tokenizer(model_args)
template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
"""


def save_model_dir(dest: Path, processor=None) -> dict:
    """vlmprep's builtin:qwen2-vl processor (or `processor`, already loaded) saved as an AutoProcessor dir, plus a
    Qwen2-VL config.json (no weights): ms-swift reads the model type and dtype from it before building its template."""
    from transformers import Qwen2VLConfig

    from vlmprep.processors.load import load_processor

    if not (dest / "config.json").exists():
        shutil.rmtree(dest, ignore_errors=True)
        (processor or load_processor("builtin:qwen2-vl")).save_pretrained(str(dest))
        Qwen2VLConfig(architectures=["Qwen2VLForConditionalGeneration"]).to_json_file(str(dest / "config.json"))
    legacy = dest / "preprocessor_config.json"  # transformers before the nested processor_config.json
    ip = (
        json.loads(legacy.read_text())
        if legacy.exists()
        else json.loads((dest / "processor_config.json").read_text())["image_processor"]
    )
    size = ip.get("size") or {}
    return {
        "min_pixels": ip.get("min_pixels") or size["shortest_edge"],
        "max_pixels": ip.get("max_pixels") or size["longest_edge"],
    }


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _arrow_summary(path: Path) -> dict:
    """Rows, columns and token count (input_ids or ms-swift's lengths) of a datasets save_to_disk dir."""
    import pyarrow as pa

    rows, tokens, columns = 0, 0, []
    for f in sorted(Path(path).rglob("*.arrow")):
        with pa.memory_map(str(f)) as src:
            table = pa.ipc.open_stream(src).read_all()
        rows += table.num_rows
        columns = table.column_names
        if "input_ids" in columns:
            tokens += sum(len(x) for x in table.column("input_ids").to_pylist())
        elif "lengths" in columns:
            tokens += sum(sum(x) if isinstance(x, list) else x for x in table.column("lengths").to_pylist())
    return {"samples": rows, "tokens": tokens, "columns": columns}


def _env(run_dir: Path, pixels: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_DATASETS_CACHE=str(run_dir / "hf-datasets"),
        MODELSCOPE_CACHE=str(run_dir / "modelscope"),
        HF_HOME=str(run_dir / "hf-home"),
        DISABLE_VERSION_CHECK="1",
        USE_MODELSCOPE_HUB="0",
        MAX_PIXELS=str(pixels["max_pixels"]),
        MIN_PIXELS=str(pixels["min_pixels"]),
        VLMPREP_CACHE=str(run_dir / "vlmprep-cache"),
    )
    return env


def command(
    tool: str, py: Path, data: dict, model: Path, out: Path, run_dir: Path, workers: int, pixels: dict
) -> list[str]:
    """Each tool's own CLI, as its docs give it, writing its preprocessed dataset to `out` (at the input set's
    seq_len)."""
    seq_len = data["seq_len"]
    if tool == "vlmprep":
        inp = data["llamafactory"] / "data.json" if data["kind"] == "demo" else data["vlmprep"]
        return [
            str(py),
            "-m",
            "vlmprep",
            "build",
            "--in",
            str(inp),
            "--out",
            str(out),
            "--processor",
            str(model),
            "--seq-len",
            str(seq_len),
            "--workers",
            str(workers),
            "--no-progress",
            "--max-reject-fraction",
            "1",
            *(["--chat-template", "qwen2_vl_tools"] if data["kind"] == "traces" else []),
        ]
    if tool == "llamafactory":
        cfg = {
            "model_name_or_path": str(model.resolve()),
            "trust_remote_code": False,
            "stage": "sft",
            "do_train": True,
            "finetuning_type": "full",
            "dataset": "bench",
            "dataset_dir": str(data["llamafactory"].resolve()),
            "template": "qwen2_vl",
            "cutoff_len": seq_len,
            "overwrite_cache": True,
            "preprocessing_num_workers": workers,
            "tokenized_path": str(out.resolve()),
            "output_dir": str((run_dir / "lf-train").resolve()),
            "image_max_pixels": pixels["max_pixels"],
            "image_min_pixels": pixels["min_pixels"],
            "report_to": "none",
        }
        path = run_dir / "llamafactory.yaml"  # JSON is YAML; its .json branch passes json.load a Path
        path.write_text(json.dumps(cfg, indent=1))
        return [str(py), "-c", LF_PREPROCESS, str(path.resolve())]
    assert tool == "ms-swift", tool
    return [
        str(py.parent / "swift"),
        "export",
        "--model",
        str(model.resolve()),
        "--model_type",
        "qwen2_vl",
        "--template",
        "qwen2_vl",
        "--dataset",
        str(data["swift"].resolve()),
        "--to_cached_dataset",
        "true",
        "--max_length",
        str(seq_len),
        "--dataset_num_proc",
        str(workers),
        "--load_from_cache_file",
        "false",
        "--split_dataset_ratio",
        "0",
        "--output_dir",
        str(out.resolve()),
        "--exist_ok",
        "true",
    ]


def _children_cpu() -> float:
    """User + system CPU seconds of every finished child process (and theirs): the work itself, which neighbours
    on a shared machine slow down far less than the wall clock."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_tool(tool: str, py: Path, data: dict, model: Path, workers: int, pixels: dict) -> dict:
    """One timed run in a fresh process on `workers` cores (taskset), its output measured afterwards."""
    run_dir = ROOT / "runs" / f"{data['name']}-{tool}-w{workers}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    out = run_dir / "out"
    cmd = command(tool, py, data, model, out, run_dir, workers, pixels)
    cores = ",".join(str(i) for i in range(workers))
    load0 = os.getloadavg()[0]
    cpu0 = _children_cpu()
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        res = subprocess.run(
            ["taskset", "-c", cores, *cmd], env=_env(run_dir, pixels), stdout=log, stderr=subprocess.STDOUT
        )
    seconds = time.perf_counter() - t0
    row = {
        "seconds": round(seconds, 2),
        "cpu_seconds": round(_children_cpu() - cpu0, 2),
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "command": " ".join(cmd),
        "out": str(out),
        "run_dir": str(run_dir),
    }
    if res.returncode or not out.exists():
        tail = (run_dir / "log.txt").read_text(errors="replace").strip().splitlines()[-6:]
        return {**row, "error": f"exit {res.returncode}: " + " | ".join(tail)}
    if tool == "vlmprep":
        m = json.loads((out / "manifest.json").read_text())
        row.update(
            samples=m["totals"]["samples"],
            tokens=m["totals"]["tokens"],
            rejected=m["totals"]["rejected"],
            output_bytes=sum(s["bytes"] for s in m["shards"]),
        )
    else:
        row.update(_arrow_summary(out), output_bytes=_bytes(out))
    return row


def inputs(quick: bool, n_traces: int, demo_repeat: int) -> list[dict]:
    demo_src = Path("/work/shared/data/llamafactory_mllm_demo")
    if not demo_src.is_dir():
        demo_src = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "llamafactory_mllm_demo"
    sets = []
    for repeat, name in ((1, "demo-1"), (demo_repeat, "demo")):
        d = convert.write_demo(demo_src, ROOT / "inputs" / name, repeat)
        sets.append({**d, "kind": "demo", "name": name, "seq_len": 4096})
    size = (320, 200) if quick else (1280, 720)
    for n, name in ((1, "traces-1"), (n_traces, "traces")):
        # No overlong trace: every tool then does the same work on every record (no tool-specific truncation).
        src = traces(
            n,
            width=size[0],
            height=size[1],
            max_images=4 if quick else 20,
            overlong_fraction=0.0,
            text_only_fraction=0.0,
        )
        d = convert.write_traces(records(src), ROOT / "inputs" / name)
        sets.append({**d, "vlmprep": src, "kind": "traces", "name": name, "seq_len": 32768})
    return sets


def versions(py: Path, names: list[str]) -> dict:
    code = "import json, importlib.metadata as m; print(json.dumps({n: m.version(n) for n in %r}))" % names
    return json.loads(subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True).stdout)


def preprocess(tool: str, py: Path, one: dict, full: dict, model: Path, workers: int, pixels: dict) -> dict | None:
    """The tool's preprocessing of `full`, its start-up set apart by a run on `one` (the 1-record input): its row,
    emitted (None where either run failed, emitted with its error)."""
    r1 = run_tool(tool, py, one, model, workers, pixels)
    rn = run_tool(tool, py, full, model, workers, pixels)
    row = {
        "input": full["name"],
        "tool": tool,
        "workers": workers,
        "records": full["records"],
        "images": full["images"],
        "seq_len": full["seq_len"],
    }
    if "error" in r1 or "error" in rn:
        emit("peers", metric="run", **row, error=rn.get("error") or r1.get("error"), command=rn["command"])
        return None
    # The 1-record run's start-up (imports, processor load) set apart; per core from the CPU seconds the run used
    # (its processes pinned to `workers` cores), and from the wall clock, which neighbours inflate.
    cpu = rn["cpu_seconds"] - r1["cpu_seconds"]
    wall = (rn["seconds"] - r1["seconds"]) * workers
    recs, imgs = full["records"] - one["records"], full["images"] - one["images"]
    result = emit(
        "peers",
        metric="run",
        **row,
        seconds=rn["seconds"],
        cpu_seconds=rn["cpu_seconds"],
        startup_seconds=r1["seconds"],
        startup_cpu_seconds=r1["cpu_seconds"],
        records_per_s_per_core=round(recs / cpu, 3) if cpu > 0 else None,
        images_per_s_per_core=round(imgs / cpu, 2) if cpu > 0 else None,
        records_per_s_per_core_wall=round(recs / wall, 3) if wall > 0 else None,
        **{k: rn[k] for k in ("samples", "tokens", "rejected", "output_bytes") if k in rn},
        source_image_bytes=full["source_image_bytes"],
        columns=rn.get("columns"),
        train_time=TRAIN_TIME[tool],
        load_avg_1m=rn["load_avg_1m"],
        command=rn["command"],
    )
    return {**result, "out": rn["out"], "run_dir": rn["run_dir"], "one_records": one["records"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers")
    ap.add_argument("--quick", action="store_true", help="tiny inputs: checks that everything runs")
    ap.add_argument("--traces", type=int, default=64, help="demo agent traces (1280x720 screenshots)")
    ap.add_argument("--demo-repeat", type=int, default=500, help="copies of the 6-record LLaMA-Factory demo")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    ap.add_argument("--workers", type=int, default=1, help="processes (and cores) per tool")
    ap.add_argument("--inputs", default="demo,traces", help="comma list of demo, traces")
    ap.add_argument(
        "--end-to-end",
        action="store_true",
        help="also each tool's train-time data path over its output, --epochs times (benchmarks/peers/endtoend.py)",
    )
    ap.add_argument("--epochs", type=int, default=3, help="train-time passes with --end-to-end")
    ap.add_argument("--batch", type=int, default=1, help="samples per batch of each train-time pass")
    a = ap.parse_args(argv)
    tools = [t.strip() for t in a.tools.split(",") if t.strip()]
    if set(tools) - set(TOOLS):
        ap.error(f"--tools: choose from {', '.join(TOOLS)}")
    if a.end_to_end and a.workers != 1:
        ap.error("--end-to-end measures one core per tool: drop --workers")
    if a.quick:
        a.traces, a.demo_repeat = min(a.traces, 3), min(a.demo_repeat, 2)
    emit("machine", quick=a.quick, cpu=_cpu_model(), load_avg=[round(x, 2) for x in os.getloadavg()], **machine())
    ROOT.mkdir(parents=True, exist_ok=True)
    model = ROOT / "model"
    pixels = save_model_dir(model)
    pys = {"vlmprep": Path(sys.executable)} if "vlmprep" in tools else {}
    for peer in [t for t in tools if t in venvs.PEERS]:
        try:
            pys[peer] = venvs.ensure(peer, ROOT)
            pkgs = [venvs.PEERS[peer]["pin"].split("==")[0], "transformers", "datasets", "torch"]
            emit("peers", metric="versions", tool=peer, **versions(pys[peer], pkgs))
        except Exception as e:  # noqa: BLE001 - a peer that cannot install is a result to report, not a crash
            emit("peers", metric="install", tool=peer, error=str(e)[-2000:])
    emit(
        "peers",
        metric="versions",
        tool="vlmprep",
        **versions(Path(sys.executable), ["vlmprep", "transformers", "torch"]),
    )
    sets = {d["name"]: d for d in inputs(a.quick, a.traces, a.demo_repeat)}
    results: dict[tuple[str, str], dict] = {}
    for name in [n.strip() for n in a.inputs.split(",") if n.strip()]:
        for tool in [t for t in TOOLS if t in pys]:
            result = preprocess(tool, pys[tool], sets[f"{name}-1"], sets[name], model, a.workers, pixels)
            if result is not None:
                results[name, tool] = result
                if a.end_to_end:
                    env = _env(Path(result["run_dir"]), pixels)
                    results[name, tool] = endtoend.train_time(result, tool, pys[tool], model, env, a.epochs, a.batch)
        base = results.get((name, "vlmprep"))
        for peer in [t for t in TOOLS[1:] if (name, t) in results and base]:
            ratio = {
                k: round(base[k] / results[name, peer][k], 2) if base[k] and results[name, peer][k] else None
                for k in ("records_per_s_per_core", "records_per_s_per_core_wall")
            }
            emit("peers", metric="ratio", input=name, vs=peer, **ratio, goal=endtoend.PREPROCESS_GOALS[name, peer])
    if a.end_to_end:
        (ROOT / "end-to-end.md").write_text(endtoend.summary(results) + "\n")
    emit("done")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


if __name__ == "__main__":
    main()
