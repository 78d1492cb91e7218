"""`load_pretrained`: the model from a converted checkpoint, each parameter placed straight onto its
sharding (each process reads only the bytes of the shards its devices hold). A quantized checkpoint gives
a quantized model (`jaxmodel.quantization`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmodel.config import ModelConfig
from jaxmodel.formats.checkpoint import (DTYPES_BY_NAME, MANIFEST, CheckpointError, checkpoint_quantization,
                                        open_tensor, read_manifest)
from jaxmodel.layers import QuantizedParam
from jaxmodel.model import CausalLM
from jaxmodel.sharding import DEFAULT_RULES, Rules, variable_sharding


def load_pretrained(path: str | Path, *, mesh: jax.sharding.Mesh | None = None, dtype=None, param_dtype=None,
                    rules: Rules = DEFAULT_RULES, remat: str = "none", attention: str = "xla",
                    mlp_chunk: int = 0, fp8_matmul: str | None = None) -> CausalLM:
    """Build the model from a converted checkpoint.

    With a mesh, each parameter is placed straight onto its sharding (from its logical axes and `rules`)
    and each process reads only the bytes of the shards its devices hold. `param_dtype` casts the stored
    weights (default: as stored), but a parameter the model keeps in a dtype of its own (DeepSeek-V3's float32
    router); `dtype` is the compute dtype (default: the embedding's dtype). The codes and scales of a quantized
    checkpoint are loaded as stored, whatever `param_dtype`. `fp8_matmul` ("e4m3fn", "e4m3fnuz"): an fp8 base's
    projections multiply in that FP8 (`Quantization.matmul`; ValueError for another base).
    """
    directory = Path(path)
    config = ModelConfig.from_hf(directory)
    manifest = read_manifest(directory)
    quantization = checkpoint_quantization(manifest, directory / MANIFEST)
    if fp8_matmul is not None:
        if quantization is None:
            raise ValueError(f"FP8 matmuls {fp8_matmul!r} on {directory}: its base is not quantized")
        quantization = dataclasses.replace(quantization, matmul=fp8_matmul)
    stored = manifest["tensors"]
    if dtype is None:
        dtype = param_dtype or DTYPES_BY_NAME[stored.get("embed_tokens.weight", {}).get("dtype", "float32")]
    try:
        abstract = nnx.eval_shape(lambda: CausalLM(config, dtype=dtype, param_dtype=param_dtype or dtype,
                                                           remat=remat, attention=attention, mlp_chunk=mlp_chunk,
                                                           rules=rules, quantization=quantization, rngs=nnx.Rngs(0)))
    except ValueError as e:
        if quantization is None:
            raise
        raise CheckpointError(f"{directory / MANIFEST}: 'quantization' does not fit config.json: {e}") from None
    for names, var in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name = ".".join(map(str, names))
        entry = stored.get(name)
        if entry is None:
            raise CheckpointError(f"{directory / MANIFEST}: no tensor '{name}', which config.json implies")
        if tuple(entry["shape"]) != tuple(var.shape):
            raise CheckpointError(
                f"{directory / MANIFEST}: '{name}' has shape {entry['shape']}, config.json implies {list(var.shape)}"
            )
        stored_array = open_tensor(directory, name, entry)
        codes = isinstance(var, QuantizedParam) and name.endswith(".codes")
        if codes and stored_array.dtype == quantization.codes_dtype:
            stored_array = stored_array.view(quantization.held_dtype)  # FP8 held as its bits; the others as stored
        if isinstance(var, QuantizedParam) and stored_array.dtype != var.dtype:
            raise CheckpointError(f"{directory / MANIFEST}: '{name}' is {stored_array.dtype}, "
                                  f"its quantization stores {np.dtype(var.dtype)}")
        # `param_dtype` is what the model declares for its parameters, but for those it keeps in a dtype of their own:
        # quantized codes and scales (checked above to be as stored), DeepSeek-V3's float32 router
        target = stored_array.dtype if param_dtype is None else np.dtype(var.dtype)
        var.set_value(_place(stored_array, target, None if mesh is None else
                           variable_sharding(var, mesh, rules)))
    return abstract


def _place(stored: np.memmap, dtype: np.dtype, sharding) -> jax.Array:
    if sharding is None:
        return jnp.asarray(np.asarray(stored).astype(dtype, copy=False))
    # Called once per addressable device with that device's index: only those bytes are read.
    return jax.make_array_from_callback(
        stored.shape, sharding, lambda index: np.ascontiguousarray(stored[index]).astype(dtype, copy=False)
    )
