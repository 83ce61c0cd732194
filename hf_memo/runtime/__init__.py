"""The memo layer executor and what it runs on: attention core, stash, host pool, copy streams, offload LP."""
