"""Files fp8ptq writes and reads, whatever they hold: outputs that appear complete or not at all
(``atomic``), JSON with one-line errors naming the place (``json_files``) and ``.pt`` files read
without running their code (``safe_pickle``)."""
