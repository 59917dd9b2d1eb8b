"""Making drafts and datastores from the target's own writing (`specdec distill`, `specdec datastore`).
The runtime never imports this package."""
