"""Regenerate ``src/onceq/rocketmq/_pb/`` (the ``apache.rocketmq.v2`` message classes).

The .proto files of RocketMQ 5's gRPC protocol are published by the Apache RocketMQ
project (github.com/apache/rocketmq-apis, Apache-2.0); the PyPI wheel of the official
Python client (``rocketmq-python-client``) carries them compiled, as serialized file
descriptors, not as .proto text. onceq takes the descriptors of the client version its
tests run against, so that both sides speak exactly the same revision of the protocol,
and compiles its own modules from them with ``grpcio-tools``:

    .venv/bin/python scripts/rocketmq_stubs.py

(needs the ``dev`` extra: ``rocketmq-python-client`` and ``grpcio-tools``). The file
names are put back to the published layout (``apache/rocketmq/v2/*.proto``), the import
between the two modules made relative, and the Apache license header kept.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys
import tempfile

OUT = pathlib.Path(__file__).resolve().parents[1] / "src" / "onceq" / "rocketmq" / "_pb"
NAMES = {"definition.proto": "apache/rocketmq/v2/definition.proto",
         "service.proto": "apache/rocketmq/v2/service.proto"}

HEADER = """\
# Licensed to the Apache Software Foundation (ASF) under one or more
# contributor license agreements.  See the NOTICE file distributed with
# this work for additional information regarding copyright ownership.
# The ASF licenses this file to You under the Apache License, Version 2.0
# (the "License"); you may not use this file except in compliance with
# the License.  You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Generated code: the messages of
#     {proto}
# (package apache.rocketmq.v2, Apache RocketMQ's gRPC protocol, published at
# github.com/apache/rocketmq-apis), compiled with grpcio-tools {tools} from the file
# descriptors shipped in rocketmq-python-client {client}.
# Do not edit: regenerate with scripts/rocketmq_stubs.py.
"""


def main() -> int:
    from google.protobuf import descriptor_pb2, duration_pb2, timestamp_pb2
    from grpc_tools import protoc
    from rocketmq.grpc_protocol import definition_pb2, service_pb2

    fds = descriptor_pb2.FileDescriptorSet()
    for mod in (timestamp_pb2, duration_pb2, definition_pb2, service_pb2):
        fd = descriptor_pb2.FileDescriptorProto.FromString(mod.DESCRIPTOR.serialized_pb)
        fd.name = NAMES.get(fd.name, fd.name)
        deps = [NAMES.get(d, d) for d in fd.dependency]
        del fd.dependency[:]
        fd.dependency.extend(deps)
        fds.file.append(fd)
    versions = {"tools": importlib.metadata.version("grpcio-tools"),
                "client": importlib.metadata.version("rocketmq-python-client")}
    with tempfile.TemporaryDirectory() as tmp:
        set_path = pathlib.Path(tmp) / "v2.pb"
        set_path.write_bytes(fds.SerializeToString())
        rc = protoc.main(["protoc", f"--descriptor_set_in={set_path}",
                          f"--python_out={tmp}", *NAMES.values()])
        if rc != 0:
            print("protoc failed", file=sys.stderr)
            return rc
        OUT.mkdir(parents=True, exist_ok=True)
        for short, full in NAMES.items():
            stem = short.removesuffix(".proto")
            text = (pathlib.Path(tmp) / full).with_name(f"{stem}_pb2.py").read_text()
            text = text.replace("from apache.rocketmq.v2 import", "from . import")
            (OUT / f"{stem}_pb2.py").write_text(HEADER.format(proto=full, **versions) + text)
    init = OUT / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated apache.rocketmq.v2 messages '
                        '(scripts/rocketmq_stubs.py)."""\n')
    print(f"written to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
