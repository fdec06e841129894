"""Download Dubai aerial imagery (Humans in the Loop, CC0) and verify every file.

The 72 image/mask pairs (`Tile <t>/images`, `Tile <t>/masks`) of the Kaggle release
`humansintheloop/semantic-segmentation-of-aerial-imagery` (CC0), from a public GitHub copy
that holds them byte for byte (its `classes.json` is not fetched: it contradicts the
published colour table).

Source: https://github.com/Bandit15/Deep-Learning-Satellite-Image-Segmentation
at commit d403f147c0eb61e5510e947ab6036ead6fd17d5e,
folder `data/`. Each file is checked against its Git blob hash (the hash that commit
records; the manifest below was computed from the verified copy in ../shared/data), so a
changed or truncated download is refused. 144 files, 33.5 MB.

    python scripts/prepare_dubai_aerial.py                 # into $REMAT_DATA_DIR/<dataset folder>
    python scripts/prepare_dubai_aerial.py --dest /data/Dubai-aerial-semantic-segmentation
    python scripts/prepare_dubai_aerial.py --verify-only   # check an existing copy, no network

Exit status 0 when every file is present with its hash, 1 otherwise (the problems are
printed). The tests never run this script.
"""

from __future__ import annotations

import sys

from remat.data.download import parse_manifest, prepare_main

BASE_URL = ("https://raw.githubusercontent.com/Bandit15/Deep-Learning-Satellite-Image-Segmentation/"
            "d403f147c0eb61e5510e947ab6036ead6fd17d5e/data/")
FOLDER = "Dubai-aerial-semantic-segmentation"
MANIFEST = parse_manifest("""
6e52cd912ba9d72849e5e4101983d596d262b394  Tile 1/images/image_part_001.jpg
5bef26fd9fa72ab9af0d2e48fc849859273c26d9  Tile 1/images/image_part_002.jpg
f1bb9b3d9ed2652270561389b992d488333556fc  Tile 1/images/image_part_003.jpg
9c61c8a2262752b99267bf6df57759d929952c46  Tile 1/images/image_part_004.jpg
afbaaefea84d799e7f90bf428118d42899fffa09  Tile 1/images/image_part_005.jpg
0056ad5e0cae21b1e7bfeb574c793a7343be032f  Tile 1/images/image_part_006.jpg
2868ae9650ef6d363286873446972f5d14a9d1a1  Tile 1/images/image_part_007.jpg
5e4618d5a8cc8c4644535d37861dd077a28f6ee9  Tile 1/images/image_part_008.jpg
be0bbb486da9faf8a62c025822eeda8a7e08a01f  Tile 1/images/image_part_009.jpg
164b14c409cb597a815cdae452b2551ec3624b43  Tile 1/masks/image_part_001.png
19047dca37fd4ddd4b3147013e257036b38a1708  Tile 1/masks/image_part_002.png
063fd6b9f01d980b7ccc4664ddc7b80eaec0ea9c  Tile 1/masks/image_part_003.png
96a8ca4ce6fbcffd5e3547731dfab9a82243c5e1  Tile 1/masks/image_part_004.png
4fc95b033dc9c51d3bed0904e6c5cdb0259e6eb8  Tile 1/masks/image_part_005.png
a025ea96b8749bebc475768a92feea5cbe64459a  Tile 1/masks/image_part_006.png
b8c11c13f842329da38044e3e6c3796fe068a463  Tile 1/masks/image_part_007.png
1f1ba95ba2e0639ddc9b3b96f2413506f1431890  Tile 1/masks/image_part_008.png
41f7f8c7cb896a743ca49c36cab8ef6315ff52ca  Tile 1/masks/image_part_009.png
70b90fdae2835f5ad5284bdc648341105d0bf4d7  Tile 2/images/image_part_001.jpg
0f4f858aa2160c28f7fbeadee46c89e4a9bdcd4e  Tile 2/images/image_part_002.jpg
6240e0fea7d17eca03fb7bd6a75e6acd19c40213  Tile 2/images/image_part_003.jpg
0c24c19a4a175661f0bffacf1e86dd1941d3950b  Tile 2/images/image_part_004.jpg
2dfee7c346872581c01bd953c85d1677bf98f5b3  Tile 2/images/image_part_005.jpg
3b45b24b4af2c503c76c90543320bc4757e369ee  Tile 2/images/image_part_006.jpg
e96d11c9e38d50a54db592e6283f9817c6db1313  Tile 2/images/image_part_007.jpg
575cc81df5bdb4a3b0bc6762f27f87bf52911b87  Tile 2/images/image_part_008.jpg
877f360a5b143e976818463db25e83d9f554b79d  Tile 2/images/image_part_009.jpg
b692216ac78af36777d8aba75314a5d286a66401  Tile 2/masks/image_part_001.png
8d0d2b708f25a180af5d8e654ac9f3451f8bb4f3  Tile 2/masks/image_part_002.png
47e2f3c46f84db92152779b81bf3e62b1e37146f  Tile 2/masks/image_part_003.png
eff3c1dc29c6c1ba8684d55f2a1ee77fd021f4ba  Tile 2/masks/image_part_004.png
b910de542c378299333746ac20f2203cee9407c7  Tile 2/masks/image_part_005.png
0148cc9659583b125d1b8300621fb47405cc3e11  Tile 2/masks/image_part_006.png
dcb28271d5e8e016e9d3059f29d8a333396cd472  Tile 2/masks/image_part_007.png
c8a68428b8334d597228554f42b53377eea026cd  Tile 2/masks/image_part_008.png
849a1d4c214fdba2ba1a595fd8318008b18fe453  Tile 2/masks/image_part_009.png
e9ec1544151437baa0a2a815d7c97ec5f1f2dd74  Tile 3/images/image_part_001.jpg
a572ed4638c45b218f99f53a61907d5f323587b9  Tile 3/images/image_part_002.jpg
005d8145de9d36d629a0d9c33229707c310f82aa  Tile 3/images/image_part_003.jpg
bdff5c9d262cdc792cd2e50ad1a12adc14ab3a96  Tile 3/images/image_part_004.jpg
b946bd79becb8ddbf0fd366a6bf440c40bf40f25  Tile 3/images/image_part_005.jpg
e668c6d8857fc716ab0a271e8604043a8b3babae  Tile 3/images/image_part_006.jpg
efdd875d19ada6956146a024d874323937f2d4a2  Tile 3/images/image_part_007.jpg
0b30977722a846ceb222fa1a206ae73ebb26f99d  Tile 3/images/image_part_008.jpg
c0a84089575fdf58f25276720ec96e8f658df3ef  Tile 3/images/image_part_009.jpg
62f02a75a74ff2844e0a0aee97ec8ae76abdb069  Tile 3/masks/image_part_001.png
e3f35ad52b4e34de1d110a59a0a112dd1db55d16  Tile 3/masks/image_part_002.png
e91037c117f3126719611456b19b813c8f897385  Tile 3/masks/image_part_003.png
b0b2b924b2021036f54d747b6bdbe3a50f0d6f43  Tile 3/masks/image_part_004.png
954e6af55916ca4d8c06cad32f648824846de66a  Tile 3/masks/image_part_005.png
34a35cf6262d6178c0ed069b9a19c947f2b48885  Tile 3/masks/image_part_006.png
072ba11424a312a5243ca896063f6e502c867fb7  Tile 3/masks/image_part_007.png
b0ecfaa39ac6a9ab787431aedfc1391b927d8640  Tile 3/masks/image_part_008.png
bf52499d7d22e892c34aa61d202004d318a7d027  Tile 3/masks/image_part_009.png
edfd41832fbd8fbb76766a55c779eb8db399b95d  Tile 4/images/image_part_001.jpg
9a4eef6dcfba8b3fd5467bd3021fa5553f9e1170  Tile 4/images/image_part_002.jpg
d7a847daa07948e58b31e84e4764b86c517204f7  Tile 4/images/image_part_003.jpg
ed3286eda823dd956a24fcb391d33a0a4cfef5c6  Tile 4/images/image_part_004.jpg
a1110fb0918643cde03c1038b2810ea8d8821653  Tile 4/images/image_part_005.jpg
cf81428680193272aef34c89406e494aba596a4f  Tile 4/images/image_part_006.jpg
631a9446899afb00c7aa5b55045355fe50b19dd5  Tile 4/images/image_part_007.jpg
3f7214f9e48506df60e775a871b7d3880b7fd858  Tile 4/images/image_part_008.jpg
5a747dbacdbe9547e2ae3da4df0766238fe8f881  Tile 4/images/image_part_009.jpg
6277c3fe2b6ec0ecbc730220921b8ba94797277c  Tile 4/masks/image_part_001.png
c885bde6f8b3c58e2f0a3b590d35127955ee7f4b  Tile 4/masks/image_part_002.png
963232983670ddc8995f5ad6674a374574d936c5  Tile 4/masks/image_part_003.png
1eea3126f3fc647c9cd37edf2f9103f41925b15d  Tile 4/masks/image_part_004.png
05965f55f5fe89da24d2cec49d19d2f5fc4cfb10  Tile 4/masks/image_part_005.png
d9da8621c6ad11f59616687ca88f3af0b15c736d  Tile 4/masks/image_part_006.png
5bc8600a8f4643141b189c7dc2c54f172d3723b0  Tile 4/masks/image_part_007.png
96a3a949ae99a96021af4ada2163d979596284be  Tile 4/masks/image_part_008.png
2b680aa7996ed5ddea7ac3ff1ed037f15cf2501e  Tile 4/masks/image_part_009.png
c47c152be595872494f1285e551a1782bec30ede  Tile 5/images/image_part_001.jpg
f03f35bd51eaa9cf7571e1b674eb82aa103a2b21  Tile 5/images/image_part_002.jpg
86eefd9d23362b661a5a4aa6c6d007a18f1b3dc5  Tile 5/images/image_part_003.jpg
3a19128935503f620d32963664da556d5b11094f  Tile 5/images/image_part_004.jpg
86d80985319d3f4cd0f5398f990ec93723bc6990  Tile 5/images/image_part_005.jpg
e966e8400654b5f442502083c8a40772a4c03459  Tile 5/images/image_part_006.jpg
99514fd79ef7539293db4ca543ca52f699601381  Tile 5/images/image_part_007.jpg
523c8421e6463d46d592e43ea2f212c55b5e7e73  Tile 5/images/image_part_008.jpg
e0ea5cac057395aed5c8cf2c78b9d087a173571d  Tile 5/images/image_part_009.jpg
ab6b4b9c920f1ced3fb959b8c45abce7e6a75689  Tile 5/masks/image_part_001.png
a02f7c2e4940c5df543eba4a9d8cab58486090b3  Tile 5/masks/image_part_002.png
2e7a624c6405504d427ff2d56495e3664090366e  Tile 5/masks/image_part_003.png
7eb0a4a55d122c03d9a4db0915aa543c84623216  Tile 5/masks/image_part_004.png
052f5d448ce4bc718878edca303702abde57b623  Tile 5/masks/image_part_005.png
3e7a4f22747e2726deb708a23504f570d37eaeb0  Tile 5/masks/image_part_006.png
16c592f77a8110719eaf71426604b33b09bb59ff  Tile 5/masks/image_part_007.png
abd7c46084977919404109229562644a06db67b5  Tile 5/masks/image_part_008.png
f3613026ad2cf09d53184c688d7ab9f04e7cad35  Tile 5/masks/image_part_009.png
4caf77c78eddfb9e5637038d9f3678fd4834a17a  Tile 6/images/image_part_001.jpg
193ad548d44b0fd6d827a531c3deaddc06bb9d5d  Tile 6/images/image_part_002.jpg
517d67bd83e9008951086c2b95db7809de0b20f3  Tile 6/images/image_part_003.jpg
134ff8d5b30f0b66196f27f9ee6544e85fc9746d  Tile 6/images/image_part_004.jpg
83c776d5872bd5373c74b88557750ec330173ccd  Tile 6/images/image_part_005.jpg
e45e2fa85c891a356a8274332fa24d6c795f0a10  Tile 6/images/image_part_006.jpg
31021ae298cde4bf0e2c4681e9e9889e2ce00cd5  Tile 6/images/image_part_007.jpg
3247b7ef07d155374c98918a0749eef00c211ee4  Tile 6/images/image_part_008.jpg
9a2eaf8d4f576c9f24dddcc48464a3f35acc2298  Tile 6/images/image_part_009.jpg
b8ae3fb3f15ce1f6250263b29cb39b3f5c1ea518  Tile 6/masks/image_part_001.png
15d0ca8b500e7051711372b1248fc07c8612dace  Tile 6/masks/image_part_002.png
24c855b5d6f0c7d469fd977b8a262df4d3b967a6  Tile 6/masks/image_part_003.png
c5b0277a0ba3fc0c450630f7249271641363139b  Tile 6/masks/image_part_004.png
f83d1c35eff4c27973ff8892f5141d2c9d14eb04  Tile 6/masks/image_part_005.png
5865fd581c9f1e6da9588e8ccc141738e05249e6  Tile 6/masks/image_part_006.png
b1d1da373dec1825ee729f5dc1021039fa922658  Tile 6/masks/image_part_007.png
5a7dee1c99b5310e96e38c355e9f65b6eb25f5f7  Tile 6/masks/image_part_008.png
a26b8295f10e9ce1a49f489275158b9a1b97b610  Tile 6/masks/image_part_009.png
1381603f4643894a4094d4e408d50f431579860b  Tile 7/images/image_part_001.jpg
a05539f141ff8e1ad9b9937600cef5d38dcdf51a  Tile 7/images/image_part_002.jpg
c5906e36fd67fde8cf9af79ba2f58bd5dc52e82b  Tile 7/images/image_part_003.jpg
a7b4370f5579e884f817e483548be8226418d71d  Tile 7/images/image_part_004.jpg
2f1366268e112705a5266b9d98016f121d81b34b  Tile 7/images/image_part_005.jpg
8af0232aee3a31a1852ee9886c7b77b1f327b7e8  Tile 7/images/image_part_006.jpg
299cd00367d2baf63e7c66f44d8ad616566dc294  Tile 7/images/image_part_007.jpg
7355e3ff371fea8a468cd9ba55ae779a1fff3112  Tile 7/images/image_part_008.jpg
550a3b600c106e25bbc1e407f7399dcd847c540f  Tile 7/images/image_part_009.jpg
d6b5f94419dd75b551c45d1f5830a0b3acd90727  Tile 7/masks/image_part_001.png
dc175e9d2e564d054ed53ef306dbdd882af3dec2  Tile 7/masks/image_part_002.png
937ab1d950db1efea848b1ce898d469d6debba62  Tile 7/masks/image_part_003.png
ab5e5671e6ba02dbcd3ae5f663ac0c6489545efb  Tile 7/masks/image_part_004.png
b65abc5f72b276b7ee8d01c7e47fe4e3dee11fb0  Tile 7/masks/image_part_005.png
edc333712c7db158157359b43bf2962689d90187  Tile 7/masks/image_part_006.png
437242b3d004660e500f4f115c7675826f1a0850  Tile 7/masks/image_part_007.png
d5e68967fc2b0cfd3872fad13673b99c85c4ce5e  Tile 7/masks/image_part_008.png
ff374997fb78639544db4923ba7104411131c10e  Tile 7/masks/image_part_009.png
f4d4275d5706effd5df08f76a718a8ef98676876  Tile 8/images/image_part_001.jpg
8529c0c51c8adae7e697e48e7146728a4df51b9f  Tile 8/images/image_part_002.jpg
b41032c3c3195b881c842e13b73d86c139fbe065  Tile 8/images/image_part_003.jpg
97675d3a9e1b21fa392fb91927c3fc26b561b56e  Tile 8/images/image_part_004.jpg
aa93950987dce1525b6b65098d3994bcbfe1c63b  Tile 8/images/image_part_005.jpg
a5e35c36fda654add701685e24239c9b8414f9fc  Tile 8/images/image_part_006.jpg
ae88c0941ab06ba7fa55c25f61df83681926f4c9  Tile 8/images/image_part_007.jpg
7340ec12b2de8bde1e685b1796094af8beb0bb6b  Tile 8/images/image_part_008.jpg
0755750d4ff8f764d38ecbe032ce99f749dc7814  Tile 8/images/image_part_009.jpg
b6602b9d6a9c4e01f4aedb8457746b51652aca04  Tile 8/masks/image_part_001.png
3bc46ecc4061b2fb49b69933e3341fd6dadc85a0  Tile 8/masks/image_part_002.png
8b1548dee7ab53b568e9f681e5965c3615f98216  Tile 8/masks/image_part_003.png
4387a685f6438462c3344fc528cf1f22c2361ce9  Tile 8/masks/image_part_004.png
8c7b00c19e677536e854bd1e7acccedf4ac041b3  Tile 8/masks/image_part_005.png
30628920cf0008334941a4afa35d22b2bf145fcd  Tile 8/masks/image_part_006.png
6bea74ddfb69afc18c5af9f7be0ea69f8101ab01  Tile 8/masks/image_part_007.png
f646bbb9f2b571f00548eefde3980296b488110e  Tile 8/masks/image_part_008.png
9f4b5d89ba709e0d1e79372c7de345ea9dd39c79  Tile 8/masks/image_part_009.png
""")


def main(argv: list[str] | None = None) -> int:
    """Download (unless ``--verify-only``) and verify; returns the exit status."""
    return prepare_main(__doc__, FOLDER, BASE_URL, MANIFEST, argv)


if __name__ == "__main__":
    sys.exit(main())
