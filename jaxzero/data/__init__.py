"""Token streams and the batches cut from them, addressed by step."""
