"""The wire package: `omnistage.v1`, the API generated from protos/ (omni_common/protogen.py).
Nothing else lives here, so every layer may import it; the `omnistage` command is
omnistage_cli."""
