"""Engines' own APIs on top of `ReshardGroup`: a vLLM weight-transfer backend (`vllm`) and the
actor handles of vLLM-on-Ray workers and Ray Train workers (`actors`)."""
