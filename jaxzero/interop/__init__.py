"""Other formats: Hugging Face weights, DeepSpeed and Accelerate configs."""
