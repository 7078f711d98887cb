"""The artifact layer: everything the compiler and the runtimes must agree on, and nothing else
(manifest, model description, pool geometry and row formats, weight formats and the quant plan,
low-bit codecs, safetensors I/O). It imports nothing of the package above it, and neither TVM's
compiler nor torch, so a host loads an artifact with this and the runtime alone."""
