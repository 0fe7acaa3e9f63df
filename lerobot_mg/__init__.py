"""Robot-learning policies (ACT, Diffusion) trained by one command on a CPU, a GPU, many GPUs or nodes."""
