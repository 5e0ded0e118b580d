"""duet_wire.v1: generated from proto/duet_wire/v1/*.proto by proto/generate.py. Do not edit."""
