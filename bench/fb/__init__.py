"""ferry's benchmark runner: ferry and QEMU on the same guest, the same link, in one run."""
