"""Download ISBI 2012 EM membranes (PNG copy) and verify every file.

The PNG sections of the ISBI 2012 challenge stacks as the Keras U-Net tutorial
`zhixuhao/unet` keeps them (`data/membrane/`), without its augmented images and
predictions. Terms: non-commercial segmentation research; cite Cardona et al. 2010 (PLoS
Biol. 8(10):e1000502) and TrakEM2 (see data/README.md).

Source: https://github.com/zhixuhao/unet
at commit b45af4d458437d8281cc218a07fd4380818ece4a,
folder `data/membrane/`. Each file is checked against its Git blob hash (the hash that commit
records; the manifest below was computed from the verified copy in ../shared/data), so a
changed or truncated download is refused. 90 files, 12.8 MB.

    python scripts/prepare_isbi2012.py                 # into $REMAT_DATA_DIR/<dataset folder>
    python scripts/prepare_isbi2012.py --dest /data/ISBI2012-EM-membrane
    python scripts/prepare_isbi2012.py --verify-only   # check an existing copy, no network

Exit status 0 when every file is present with its hash, 1 otherwise (the problems are
printed). The tests never run this script.
"""

from __future__ import annotations

import sys

from remat.data.download import parse_manifest, prepare_main

BASE_URL = ("https://raw.githubusercontent.com/zhixuhao/unet/"
            "b45af4d458437d8281cc218a07fd4380818ece4a/data/membrane/")
FOLDER = "ISBI2012-EM-membrane"
MANIFEST = parse_manifest("""
7401872a5a3db96c1d57452cb38aff9bea7dcd7a  test/0.png
fa089074c42530e76506a47689729e9e7f542fab  test/1.png
98d4d6b830ac85c8fb4110509d071cdf01b4db92  test/10.png
e2ab0c3786308168584f5a16b6b9b96fc3642195  test/11.png
cc657efb5292555cb7f285859c24633b924f2861  test/12.png
42dd46e70ea47a282eed45ccaa49ed2904eaac3f  test/13.png
d3f11e88d5f7421c41825124194ec4bef10d3efb  test/14.png
5c09fa91e587fdd1812bb6b624ca4e7ffcee58aa  test/15.png
7682736b20e6944d91b5326a7aaeb14d0df5e3c9  test/16.png
b0d4653e81c69daceaf32c627178eef76d9172cb  test/17.png
024d321616b47b60a30f72d078b611dee541c5a6  test/18.png
8c286eaaf2a27b20a05997d3fab8b0ca851eba5d  test/19.png
155daa6bbc073207d1799f1ce2427fd0c680cd13  test/2.png
aa4ac7f887bd7baf8761fb8d271387a45fc372fd  test/20.png
7fc735e6068d017f4aa0ead76783c899d2512405  test/21.png
a3ea89570d8ea6b0a08230d5b199c1039de9c5ba  test/22.png
7ba3dd67714762051b1903a5d9dcda70be6e5526  test/23.png
eb27e8b90d846975b7763a5689c21674716ac1e2  test/24.png
3985714ba3d496d7e433131ad686875e8ca0f48f  test/25.png
895e774fb808caffe2b5c4166fa74cf7206e2807  test/26.png
a41d781f12423e806abc5a5ee43aefa3a44ca6ef  test/27.png
e91b2dd28d0633265241e343e29cee1ba4981b26  test/28.png
e95fb6e5a34d3492819f8cf5788aba4251f066ce  test/29.png
ec4364341b4ea5903d88c945a9880692d7a1199b  test/3.png
c40ca861bd4af285570cb3cd041ab6090c4069d9  test/4.png
4fc82a571d2917245deee526e31e7697681b5adf  test/5.png
927cd81c896e512892aba5f5189c266fe7b414b1  test/6.png
96188411a7d210e04c4cf543d923e6da607d36bc  test/7.png
71bd9b49d224f691dc8f4bae550ec7f7bb2296d8  test/8.png
78d171a06268c8ea672a4a0e067da7e24883bed8  test/9.png
95f3aaa15b25dbb742995f53984ed8e037d92618  train/image/0.png
0d5cdf42fc1d05ae34cd248039edad5e637d3e35  train/image/1.png
e8923bdae858cb21fc8b61be409d1b12733b7abe  train/image/10.png
689924cb818d612f81afae72cbb34efeaeeb5526  train/image/11.png
e5d9f39c7d0b00c3bec0df81d0a30fa4ace34945  train/image/12.png
8d7ab60894699e9b898db1f4b8a493988c528c60  train/image/13.png
2611d52abff83a5948f9dfef5fb60cf32b4b9f36  train/image/14.png
8fa1a18c7454b22f10cba1ba6c6a5ca1f4c3acfd  train/image/15.png
13090cc9bcebe11928bcea688b9958ffda97d7e1  train/image/16.png
0e33e8f566e309d030ed741f238daa81cf6c3ead  train/image/17.png
4c2a7faf7bfbf8fc01596ee914c3fe11a9508b50  train/image/18.png
9d17745c713dfaf6686da80861f3c3e68ed7000d  train/image/19.png
ecf757a3556324dedb5a9d9bc94acd06a20d29a9  train/image/2.png
810e1086ea4ddb623aaf05ac79da0171493241b5  train/image/20.png
177783a68172c78ff22c402b0ed35062de915c13  train/image/21.png
a429f8e161b4b1503da1ec0880579f8eadbcef58  train/image/22.png
fc59728f66d585e85001d80c1689c7eb9d93c810  train/image/23.png
db4aa1ad7742d032b19fd39ca458b85d43a3ef57  train/image/24.png
a2ec682539b45f64c9d8c47961c6f8ebc825bec2  train/image/25.png
ed5bfb3036267899850f7c1bc735689e43a716fe  train/image/26.png
779f809e94929db240102ebba81b5b338b92eeb1  train/image/27.png
56d8beda95762d945de602ef6bd6b8e581934e53  train/image/28.png
4d074a29691cc84225f2dffe42de543abaecba71  train/image/29.png
7b8ef3e6b61fab1ef4fb4db416d865834298e294  train/image/3.png
8f0835cb0f1757b867501509d0a54999c9bbe0fe  train/image/4.png
797192f5763c0be0af3543bffd88537eb2dd5e6e  train/image/5.png
8a7d3d22c96d876e7da3239f24da6f3a192bbb75  train/image/6.png
8a472d73ee900ac5633f3c664784f0c1a3bb2ca2  train/image/7.png
a88ed01dae997626a131080dd167757ec13ec404  train/image/8.png
4ead8a5106e5491541258cbad95d10cb68c61597  train/image/9.png
80d4d9479c11ce119ae103c5efc893f625498b1e  train/label/0.png
8f99c6937ad5d033399d2190010ea099ceabfce2  train/label/1.png
8dd0b6e455a79019f26f265b8af6ff85c9d24d92  train/label/10.png
8c4a5517bff82204859b589f666dad9eb4c77ff6  train/label/11.png
9457bc754f1f5b145205cfe7552ff122b70c86bd  train/label/12.png
7dd67c064c480e5b229280728e0d5f7f6e979720  train/label/13.png
57fe62e2634b2c75a55441de42e23334c2238b25  train/label/14.png
beb5cf0a56765468b5e706c0794b0def57e3be0e  train/label/15.png
8b3b3b49e97a501ae3c4fa995a32ee33a45269e5  train/label/16.png
d445e73cf93adea4dc729cd73b9191971ce7ffe6  train/label/17.png
52343e8bbad43075b3ebeffe17346401f18dedae  train/label/18.png
a46da01a3ec57a5432ed22618fc620e6e78d7c70  train/label/19.png
b0525e7c33739fdeb68253b69779c98e089849ed  train/label/2.png
884f6ae7b43b0a6dbab63ef38632ec1d36640644  train/label/20.png
22be1a83c0114abf545a03df798b9aa276313726  train/label/21.png
d45b5e350252cdfc828ea7725431d34e5b256105  train/label/22.png
b6f35f89515c2f1e85456f9cc31c69546e5a4d87  train/label/23.png
f30d1dee5281ecc04629f0063bf160d26409b993  train/label/24.png
95c335921429dd2970e11b5193c89badb9a4784e  train/label/25.png
f799366633b80492a7e6d3570fac556411fd2a89  train/label/26.png
f831a591d0a0a7e254d9d9fbe3978b6da22d5d12  train/label/27.png
7323decc6427ab3c0200c534ff49249469c8165e  train/label/28.png
5892b22557994ea11868a9cea977f116c387cb52  train/label/29.png
ab5499e1c3f253629785f8dfab9ab1461a28b570  train/label/3.png
16b0929d1494cd79fb7d31d0200051594ee0ab24  train/label/4.png
367f9df98e5464af53625cceac0ec74cf02379dc  train/label/5.png
0e206e92dd907d5d9f433baaae7a6f0f26c6f2e1  train/label/6.png
a83d9263e8a6379205255798ac97c91aaf84c0d5  train/label/7.png
e6d80ecf6f937a3a9e3775b8380d1c714e8ec3d1  train/label/8.png
ede999b91d4fc5cece180c8d8ed2569e5063d60b  train/label/9.png
""")


def main(argv: list[str] | None = None) -> int:
    """Download (unless ``--verify-only``) and verify; returns the exit status."""
    return prepare_main(__doc__, FOLDER, BASE_URL, MANIFEST, argv)


if __name__ == "__main__":
    sys.exit(main())
