"""`jaxspec bench`, the end-to-end benchmark (`sweep`), and the pieces the bench/ scripts share:
model shapes (`shapes`), profiler-trace parsing (`trace`), ahead-of-time compilation (`compile`)."""
