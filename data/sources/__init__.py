"""Per-media-kind input reading and processing for `data.make_shards`.

`common` holds the input records and the folder/manifest readers shared by every kind; `image`,
`video`, `mesh` and `conversation` each turn one input into WebDataset samples. The CLI, the
resumable shard writer and the report live in `data.make_shards`, which imports the sources and
never the other way round.
"""
