"""writer.py: the names it held before the split still resolve, to the one definition each."""
import megamoe_convert.output.writer as writer
from megamoe_convert.output import output_dir, shard_writer, temp_folder
from megamoe_runtime.files import digests
from megamoe_runtime.format import manifest
from megamoe_runtime.load import verify


def test_every_former_name_is_the_moved_definition():
    homes = (shard_writer, temp_folder, output_dir, digests, manifest, verify)
    for name in writer.__all__:
        obj = getattr(writer, name)
        assert any(getattr(m, name, None) is obj for m in homes), name
