"""`prepare --weights auto`: each part's weight format, from the source and the devices that run each half.

The one place that choice is made. `choose` is a pure function of what it is told: the source's kind, the
types its decoder-layer weights are stored in, the int8 product the local CPU runs and the device the cloud
half will run on. `auto_formats` tells it that about a loaded source and this machine. prepare logs the
returned reason and writes it into both manifests (`weights_reason`).

What it chooses:

- **A CPU with an int8 product, splitinfer's (kernels/w8a8.py, AVX-512 VNNI) or FBGEMM's: int8 for every part
  it runs.** int8 is exact by construction (integer accumulation, so each row of a tree has the bits it has
  alone: speculation is token-identical to sequential decoding in-format), a quarter of float32's bytes, and
  measured faster than float32 on either kernel (the numbers are in RECOMMENDED's comment). This holds for any
  float or GGUF source: a float checkpoint (float32, float16, bfloat16 safetensors) is quantized per row; a
  GGUF's blocks are first dequantized (transformers does it as it loads) and quantized again to int8.
- **Where only torch._int_mm runs (a torch without FBGEMM: not x86), or no integer product does: every weight
  in --dtype.** No stored run measured int8 there; float32 is exact too.
- **A GPU cloud: the cloud's layers in bfloat16.** A GPU has no integer kernels here: it loads an int8 shard as
  the floats it stands for, in serve's --dtype (bfloat16 in docs/deploy.md), so int8 would buy it no speed and
  cost one more rounding. (No format here makes a GPU's products keep each row's bits; bfloat16 is what it
  computes in.)
- A source whose layer weights are in no type named here (an integer-packed GPTQ/AWQ checkpoint): --dtype.

The file's own blocks are kept only where a kernel multiplies by them as stored: `--weights int4` keeps a
Q4_0/Q4_1 GGUF's blocks (model/gguf_blocks.py). The int8 kernels take one scale per output row, so no GGUF
block type can be used as it is in int8: Q8_0's blocks carry one float16 scale per 32 weights, and the K-quants
one 4- to 8-bit scale per 16 or 32 weights inside 256-weight super-blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import WeightFormats

# GGML types whose values transformers dequantizes (gguf-py) and int8 quantizes again.
GGUF_BLOCKS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
               "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0")
FLOATS = ("F32", "F16", "BF16", "F64", "float32", "float16", "bfloat16", "float64")  # GGUF/safetensors and torch names
# The int8 products `auto` chooses int8 on, by what runs (model/linears.py's kernel_class): measured faster than
# float32 on the shipped model (see RECOMMENDED).
MEASURED_INT8 = ("splitinfer", "fbgemm")
CLOUD_DEVICES = ("cpu", "cuda")

# Every part in int8 on a CPU with splitinfer's or FBGEMM's int8 product. Local-only greedy decoding on one
# pinned core (notes/bench/weights-auto): on the shipped SmolLM2 GGUF (Q4_1) int8 ran 4.5x float32 with
# splitinfer's kernels and 1.4x with none of them (FBGEMM's int8 product, transformers' layers), at +0.23% and
# +0.83% perplexity; on Gemma 3 270M's Q4_K_M GGUF 2.9x with splitinfer's kernels, at +2.27% (most of it in
# the cloud's layers; SmoothQuant's alpha at 0.5 or 0.85 does not bring it under 1%). Every tree equalled its
# own sequential decoding. Against the 4-bit blocks kept as they ship (int4, an int8 LM head) int8's split
# tree ran faster, a tree row costing an int8 product less than Q4_1's per-block epilogue, at a perplexity
# closer to float32's (docs/benchmarks.md#weight-formats).
RECOMMENDED = WeightFormats(local="int8", cloud="int8", lm_head="int8")


@dataclass(frozen=True)
class Choice:
    """What `auto` chose: the formats (None: every weight in --dtype) and the sentence saying why."""

    weights: WeightFormats | None
    reason: str


def choose(kind: str, types: set[str], int8_product: str | None, cloud_device: str = "cpu",
           dtype: str = "float32") -> Choice:
    """The formats for a source of `kind` (SourceModel.kind: 'gguf', 'safetensors', 'checkpoint', 'memory') whose
    decoder-layer weights are stored as `types`, prepared on a CPU running `int8_product` ('splitinfer',
    'fbgemm', 'int_mm' or None) for a cloud on `cloud_device` ('cpu' or 'cuda'); `dtype`: the shards' compute
    dtype."""
    assert cloud_device in CLOUD_DEVICES, cloud_device
    named = ", ".join(sorted(types)) or "nothing"
    if not types or any(t not in GGUF_BLOCKS + FLOATS for t in types):
        return Choice(None, f"the {kind} source's layers are stored as {named}, not a float or GGUF block type "
                            f"auto quantizes: every weight in {dtype}")
    if int8_product in MEASURED_INT8:
        local = "int8"
        kernel = "splitinfer's AVX-512 VNNI" if int8_product == "splitinfer" else "FBGEMM's"
        why = (f"{kernel} int8 product runs on this CPU (exact, measured faster than float32): local layers and "
               "LM head int8")
    else:
        local = dtype
        runs = "only torch._int_mm" if int8_product else "no integer product"
        why = (f"this CPU runs neither splitinfer's nor FBGEMM's int8 product ({runs}, not measured faster than "
               f"float32): local layers and LM head {dtype}")
    if cloud_device == "cuda":
        cloud = "bfloat16"
        cloud_why = "a GPU cloud multiplies floats (int8 would be dequantized at load): cloud layers bfloat16"
    else:
        cloud, cloud_why = local, f"a CPU cloud: cloud layers {local}"
    blocks = sorted(t for t in types if t in GGUF_BLOCKS)
    if local == "int8" and blocks:
        kept = "; `--weights int4` keeps them as shipped" if set(blocks) <= {"Q4_0", "Q4_1"} else ""
        source = (f"the GGUF's {', '.join(blocks)} blocks dequantized and quantized again to int8 (its kernels take "
                  f"one scale per output row, the blocks one per 16-32 weights{kept})")
    else:
        source = f"{kind} layers stored as {named}"
    weights = None if local == cloud == dtype else WeightFormats(local=local, cloud=cloud, lm_head=local)
    return Choice(weights, f"{source}; {why}; {cloud_why}")


def int8_product_here() -> str:
    """The int8 product an int8 linear gets on this CPU (model/linears.py's kernel_class, its shape check
    aside): 'splitinfer', 'fbgemm' or 'int_mm'. Call kernels.ensure() first, as prepare does."""
    from .. import kernels
    from .linears import fbgemm_works

    if kernels.runs("w8a8"):
        return "splitinfer"
    return "fbgemm" if fbgemm_works() else "int_mm"


def source_types(source) -> set[str]:
    """The types a SourceModel's decoder-layer weights are stored in: as read from its file, else as its
    model holds them (torch dtype names)."""
    if source.stored_types:
        return set(source.stored_types.values())
    return {str(t.dtype).removeprefix("torch.") for k, t in source.model.state_dict().items()
            if k.startswith("model.layers.") and k.endswith(".weight") and t.dim() == 2}


def auto_formats(source, dtype: str = "float32", cloud_device: str = "cpu") -> Choice:
    """`choose` for a loaded SourceModel (model/source.py), prepared on this machine for a cloud on `cloud_device`."""
    return choose(source.kind, source_types(source), int8_product_here(), cloud_device, dtype)
