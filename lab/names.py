"""Names every layer shares (MaxText's `common_types.py`): constants only, no imports.

Logical axes are the names weights and activations carry (lab/model.py, lab/decode.py);
one rule table per strategy (lab/mesh.py) maps them onto the mesh axes. Tensor names and
einsum strings use one letter table everywhere (DESIGN.md): B batch · L query length ·
S key/cache length · D d_model · H query heads · G key/value heads · R = H/G query heads per
kv head · K head dim · F MLP hidden · V vocabulary · M microbatches · P pipeline stages.
Inside a kernel, a tile's dimensions use the letter of the axis it is a block of.
"""

# Logical axes of weights and activations.
BATCH = "batch"  # sequences
SEQ = "seq"  # positions of a sequence (queries, keys, cache entries)
EMBED = "embed"  # d_model, the residual stream
HEADS = "heads"  # attention heads: query heads H, or key/value heads G
HEAD_DIM = "head_dim"  # K, the features of one head: never split
MLP = "mlp"  # F, the MLP's hidden width
VOCAB = "vocab"  # V
LAYERS = "layers"  # the stacked blocks of scan_layers=true
NORM = "norm"  # RMSNorm scales (tiny: replicated)

# Mesh axes: one physical mesh always has all of them (size 1 where unused). `stage` holds
# pipeline stages (lab/kernels/pipeline.py): neighbours exchange one microbatch per tick.
DATA, STAGE, FSDP, MODEL = "data", "stage", "fsdp", "model"
MESH_AXES = (DATA, STAGE, FSDP, MODEL)

# Sharding strategies (lab/mesh.py has their rule tables); auto picks from the mesh.
STRATEGIES = ("dp", "fsdp", "tp", "fsdp+tp", "cp", "pp", "pp+fsdp", "pp+tp")
PIPELINE_STRATEGIES = ("pp", "pp+fsdp", "pp+tp")

# Attention implementations (lab/kernels/attention dispatches on these names). auto picks the
# best one for the backend.
ATTENTION_IMPLS = (
    "naive",
    "blockwise",
    "pallas",
    "pallas_tpu",
    "pallas_gpu",
    "pallas_mgpu",
    "xla",
    "cudnn",
    "ring",
    "cpu_flash",
)

# Remat (activation checkpointing) policies of a block (lab/model.py); offload is full remat
# with each block's input kept in host memory instead of device memory.
REMATS = ("none", "full", "dots", "offload")

# Memory kind of host memory a device can address (JAX memory kinds: device, pinned_host).
HOST_MEMORY = "pinned_host"

# Storage and compute dtypes a user may name, with their aliases.
DTYPES = {
    "float32": "float32",
    "f32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "f16": "float16",
    "fp16": "float16",
}
