"""The data-parallel layouts (DDP, FSDP2, HSDP) through Accelerate: accelerator, wrapping, memory, faults."""
