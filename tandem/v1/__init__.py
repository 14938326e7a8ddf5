"""Generated code of the public API, version 1 (``proto/tandem/v1/tandem.proto``; regenerate with
``bash scripts/gen_proto.sh``)."""
