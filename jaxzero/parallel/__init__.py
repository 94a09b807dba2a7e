"""Where state lives: the named device mesh and the ZeRO stages as sharding layouts."""
