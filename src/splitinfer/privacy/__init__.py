"""The privacy audit: what the cloud can recover from the hidden states it sees, and the defences' cost.

corpus    offline documents (stdlib docstrings, licence texts) with planted canaries, split by document
collect   one forward per document; the hidden states the cloud would see at every depth
attackers A1 nearest embedding / logit lens, A2 single-activation MLP, A3 sequence transformer
exact     A4 known-weights exact matching
stats     bootstrap intervals over documents, exact McNemar tests, frequency buckets
privatize private local weights from a secret seed, with their utility cost
basis     a secret residual basis or linear key per deployment (privatize --basis [--key linear]);
          basis_check its cost
keyed     threats T3-T5 against either key: observer without the cloud shard, host, known plaintext
whiten    A9: whitening and an orthogonal alignment, the statistical attack on any linear key
table     the threat-model table of the docs, written from audit.json
audit     the runs and audit.json; report: Markdown and plots; commands: the CLI
"""
