"""The benchmark's records in each peer's own input format: OpenAI-format agent traces (base64 screenshots, tool
calls) -> image files + a LLaMA-Factory ShareGPT json (with its dataset_info.json) and an ms-swift jsonl; the
LLaMA-Factory demo (already ShareGPT, image paths) repeated to a measurable size, for all three tools."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

LF_COLUMNS = {"messages": "messages", "images": "images", "tools": "tools"}
LF_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}


def _image_bytes(part: dict) -> bytes:
    url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
    assert url.startswith("data:image/"), f"demo traces embed their screenshots, got {url[:40]!r}"
    return base64.b64decode(url.split(",", 1)[1])


def _flatten(content, images: list[str], img_dir: Path, key: str) -> str:
    """A message's parts -> one string with an <image> marker where each image stood; images written as files."""
    if isinstance(content, str):
        return content
    out = []
    for part in content:
        if part["type"] == "text":
            out.append(part["text"])
        else:
            path = img_dir / f"{key}-{len(images):03d}.png"
            path.write_bytes(_image_bytes(part))
            images.append(str(path.resolve()))
            out.append("<image>")
    return "".join(out)


def _arguments(call: dict) -> dict:
    args = call["function"]["arguments"]
    return json.loads(args) if isinstance(args, str) else args


def trace_to_peers(rec: dict, img_dir: Path) -> tuple[dict, dict]:
    """One agent trace -> (LLaMA-Factory ShareGPT record, ms-swift record), sharing the same image files.
    LLaMA-Factory: system / user / function_call / observation / assistant turns, the assistant's words before a
    tool call kept as the call's thought (its default thought words `<think>\n...\n</think>\n\n`); ms-swift: the
    OpenAI messages as they are (it converts tool_calls itself), content flattened to strings with <image>."""
    images: list[str] = []
    swift_msgs, lf_msgs = [], []
    for m in rec["messages"]:
        text = _flatten(m.get("content") or "", images, img_dir, rec["id"])
        sm = {"role": m["role"], "content": text}
        if m.get("tool_calls"):
            sm["tool_calls"] = [
                {
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.dumps(_arguments(c), ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ]
            calls = [{"name": c["function"]["name"], "arguments": _arguments(c)} for c in m["tool_calls"]]
            body = json.dumps(calls if len(calls) > 1 else calls[0], ensure_ascii=False)
            thought = f"<think>\n{text}\n</think>\n\n" if text else ""
            lf_msgs.append({"role": "function_call", "content": thought + body})
        else:
            lf_msgs.append({"role": {"tool": "observation"}.get(m["role"], m["role"]), "content": text})
        swift_msgs.append(sm)
    tools = json.dumps(rec.get("tools") or [], ensure_ascii=False)
    return (
        {"messages": lf_msgs, "images": images, "tools": tools},
        {"messages": swift_msgs, "images": images, "tools": tools},
    )


def write_traces(recs: list[dict], out: Path) -> dict:
    """Agent traces -> out/llamafactory/{data.json, dataset_info.json}, out/swift/data.jsonl, out/images/."""
    shutil.rmtree(out, ignore_errors=True)
    img_dir = out / "images"
    img_dir.mkdir(parents=True)
    lf, sw = [], []
    for rec in recs:
        a, b = trace_to_peers(rec, img_dir)
        lf.append(a)
        sw.append(b)
    return _write(out, lf, sw, tools=True)


def write_demo(src: Path, out: Path, repeat: int) -> dict:
    """The LLaMA-Factory demo repeated `repeat` times, each copy naming its own copies of the images (as a real
    dataset's records do: no tool can reuse an image it has seen). One json for vlmprep and LLaMA-Factory (its own
    layout, image paths relative to the file) and one jsonl for ms-swift (the same messages, absolute paths)."""
    shutil.rmtree(out, ignore_errors=True)
    base = out / "llamafactory"
    base.mkdir(parents=True)
    recs = []
    for k in range(repeat):
        shutil.copytree(src / "mllm_demo_data", base / f"mllm_demo_data_{k:05d}")
        recs += [
            {**r, "images": [p.replace("mllm_demo_data/", f"mllm_demo_data_{k:05d}/", 1) for p in r["images"]]}
            for r in json.loads((src / "mllm_demo.json").read_text())
        ]
    absolute = [{**r, "images": [str((base / p).resolve()) for p in r.get("images", [])]} for r in recs]
    return _write(out, recs, absolute, tools=False)


def _write(out: Path, lf: list[dict], sw: list[dict], *, tools: bool) -> dict:
    (out / "llamafactory").mkdir(parents=True, exist_ok=True)
    (out / "swift").mkdir(parents=True, exist_ok=True)
    (out / "llamafactory" / "data.json").write_text(json.dumps(lf, ensure_ascii=False))
    columns = {k: v for k, v in LF_COLUMNS.items() if tools or k != "tools"}
    info = {"bench": {"file_name": "data.json", "formatting": "sharegpt", "columns": columns, "tags": LF_TAGS}}
    (out / "llamafactory" / "dataset_info.json").write_text(json.dumps(info, indent=1))
    with open(out / "swift" / "data.jsonl", "w") as f:
        for r in sw:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    base = out / "llamafactory"
    files = {(base / p).resolve() for r in lf for p in r.get("images", [])}  # what a path-keeping output needs
    return {
        "llamafactory": base,
        "swift": out / "swift" / "data.jsonl",
        "records": len(lf),
        "images": sum(len(r.get("images", [])) for r in lf),
        "source_image_bytes": sum(f.stat().st_size for f in files),
    }
