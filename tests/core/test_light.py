"""deltasync stays light: the manifest, store, status and adapter layers import no torch, and no
core module imports vLLM (checked in a fresh interpreter)."""

import subprocess
import sys


def _loaded(modules: str) -> set[str]:
    code = (
        f"import sys\nimport {modules}\n"
        "print(' '.join(m for m in ('torch', 'vllm', 'transformers', 'gradio') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_manifest_store_status_import_no_torch():
    assert (
        _loaded(
            "deltasync, deltasync.manifest, deltasync.store, deltasync.status, deltasync.adapter"
        )
        == set()
    )


def test_codec_publisher_subscriber_import_no_vllm():
    assert "vllm" not in _loaded("deltasync.codec, deltasync.publisher, deltasync.subscriber")
