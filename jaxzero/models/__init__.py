"""Model definitions. Nothing here knows about meshes or devices."""
