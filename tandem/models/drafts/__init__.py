"""Drafts: EAGLE, EAGLE-3 and MTP (chained one-layer models over the target's hidden states,
:mod:`~tandem.models.drafts.chained`), n-gram prompt lookup and suffix decoding (model-free). Each
module's ``build`` is the loading registry's entry (:data:`tandem.models.loading.DRAFT_MODULES`)."""
