"""omnistage's top: `v1`, the API generated from protos/, and `cli`, the `omnistage` command, which
composes omni_common and services (so neither of those imports the other upward)."""
