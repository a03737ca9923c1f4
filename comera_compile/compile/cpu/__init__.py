"""CPU-only compile passes and process-wide host memory settings (see README.md here):
hashed dropout masks, row sums in blocks, thin matmuls turned around, kernels pooled into
one compiler run, inductor's dtype rules built once, and the host allocator modes."""
