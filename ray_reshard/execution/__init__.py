"""Bytes in one process (no Ray, no channels): compiled per-process programs and their wire
format (`program`), packing and shard views (`pack`), which local tensors share memory
(`overlap`), and the reference run of a whole plan in one process (`reference`)."""
