"""The error of an asset that is not in the cache and may not be fetched: raised by released_assets,
caught by the deferred fetches a process runs as it ends (deferred_fetches)."""


class AssetMissingError(RuntimeError):
    """An asset is not in the cache and may not be fetched (offline); the message is one line."""
