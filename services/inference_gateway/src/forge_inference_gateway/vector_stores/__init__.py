"""A tenant's documents on the public API, in the shape of OpenAI's Files and Vector Stores API:
the use case (``service``), its HTTP routes (``api``), its tables (``rows``), its checked inputs
and answers (``values``) and the retriever it writes to and searches (``index``)."""
