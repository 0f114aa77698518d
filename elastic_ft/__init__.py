"""elastic-ft: make PyTorch distributed training survive faults fast."""
