"""Adapters to the frameworks shadowgba plugs into; every TorchRec internal it touches lives here."""
