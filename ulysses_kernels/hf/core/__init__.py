"""The core of the Hugging Face layer: the guard's rules, attaching a context to a model, the
``"ulysses"`` attention and mask functions, the batch a rank holds, the exact heads
(docs/architecture.md, "The Hugging Face layer"). Builds on families/ (what one family
needs), the context and the model's make-up; training/, inference/ and rl/ build on it."""
