"""Other frameworks' configs (DeepSpeed's ds_config, Accelerate's FSDP YAML) as jaxzero settings."""
