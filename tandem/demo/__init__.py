"""Everything that builds the demo assets: the generated corpus, the tokenizer and `tandem train-demo`."""
