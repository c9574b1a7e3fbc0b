"""The bundled ZeRO engine."""
