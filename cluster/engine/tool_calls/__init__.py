"""Tool calls: the functions a chat offers the model (``tools.py``), the text formats models
write calls in (``formats.py``), the stream parser that turns that text into calls
(``parser.py``), the constraint that holds the output to the tools' schemas
(``constraint.py``), and the tool prompt for chat templates that know nothing of tools
(``polyfill.py``)."""
