"""Every parallel axis in one place: the named device mesh, the ZeRO stages as sharding
layouts (with Megatron's tensor splits), the rules that place any model's parameters,
and the pipeline schedules with the model cut they and ZeRO-Infinity share."""
